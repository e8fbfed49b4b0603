"""Validation: forward-only passes over the validation set, one reduction, the printed loss and PPL."""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_weipipe.training.console import print_rank_0
from megatron_weipipe.training.loop_state import TrainingRun, TrainState
from megatron_weipipe.training.loss_reduction import loss_values, reduce_losses, reports_loss
from megatron_weipipe.training.step import next_microbatches


def evaluate(run: TrainingRun) -> Optional[float]:
    """The mean lm loss over ``--eval-iters`` global batches of validation data (None if none)."""
    schedule = run.schedule
    for chunk in schedule.model_chunks:
        chunk.eval()
    values, contributes = [], False
    with torch.no_grad():
        for _ in range(run.cfg.training.eval_iters):
            # Megatron-LM evaluates at --global-batch-size, not at a ramp's current one
            microbatches = next_microbatches(run.valid_iter, schedule.local_microbatches(run.cfg.num_microbatches))
            result = schedule.forward_backward(run.hooks.forward_step, microbatches, forward_only=True)
            run.housekeeping.after_evaluation_step()
            contributes = reports_loss(result, run.ctx.groups)
            values += loss_values(result)
    for chunk in schedule.model_chunks:
        chunk.train()
    return reduce_losses(schedule.ctx, values, contributes, []).mean


def run_validation(run: TrainingRun, state: TrainState) -> None:
    """Evaluate, count the samples read, print Megatron's validation block and log it."""
    with run.housekeeping.evaluation():
        value = evaluate(run)
    state.consumed_valid_samples += run.cfg.training.eval_iters * run.cfg.training.global_batch_size
    if value is None:
        return
    ppl = math.exp(min(20.0, value))
    bar = "-" * 100
    print_rank_0(
        f"{bar}\n validation loss at iteration {state.iteration} | lm loss value: {value:.6E} | "
        f"lm loss PPL: {ppl:.6E} | \n{bar}"
    )
    scalars = {"lm-loss-validation": value}
    if run.cfg.logging.log_validation_ppl_to_tensorboard:
        scalars["lm-loss-validation-ppl"] = ppl
    run.writers.scalars(state.iteration, scalars)
