"""One training iteration: forward/backward through the schedule, the reduced iteration
flags, the NaN/Inf policy, the optimizer and learning-rate step.

The loop (loop.py) counts, logs, validates, saves and decides to stop; the step only
reports what happened (``StepOutcome``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron_weipipe import faults
from megatron_weipipe.training.console import print_rank_0
from megatron_weipipe.training.loop_state import TrainingRun
from megatron_weipipe.training.loss_reduction import (
    ReducedLosses,
    first_bad_microbatch,
    loss_values,
    reduce_losses,
    reports_loss,
)


class NaNError(RuntimeError):
    """Loss or gradient norm is NaN/Inf and the run was told not to skip such steps."""


@dataclass
class StepOutcome:
    """What one iteration did, the same on every rank (all from reduced values)."""

    loss: float  # the mean lm loss over the global batch; NaN if no finite one
    grad_norm: Optional[float]  # None: no norm was computed (a NaN loss vetoed the step, or fp16 overflow)
    stepped: bool  # the optimizer updated the weights
    nan: bool  # a NaN/Inf loss or gradient norm was seen
    signal_received: bool  # some rank got SIGTERM
    duration_passed: bool  # --exit-duration-in-mins has passed (rank 0's clock)
    num_zeros: Optional[float] = None  # zero gradient entries (--log-num-zeros-in-grad, log iterations only)


def next_microbatches(iterator, n: int) -> list[dict]:
    return [next(iterator) for _ in range(n)]


def train_step(run: TrainingRun, iteration: int) -> StepOutcome:
    """Run iteration ``iteration`` (1-based): the schedule's forward/backward, one
    all-reduce of losses and exit flags, then the optimizer step unless NaN/Inf vetoes it."""
    ctx, schedule, optimizer = run.ctx, run.schedule, run.optimizer
    faults.set_phase("reading data", iteration)
    # this iteration's share of megatron-core's count (the loop updated the calculator)
    microbatches = next_microbatches(run.train_iter, schedule.local_microbatches(run.batch_sizes.num_microbatches))
    faults.set_phase(faults.TRAIN_STEP, iteration)
    ctx.bytes.reset()
    schedule.zero_grad()
    optimizer.zero_grad()
    result = schedule.forward_backward(run.hooks.forward_step, microbatches)
    run.housekeeping.after_forward_backward()
    values = loss_values(result)
    reduced = reduce_losses(ctx, values, reports_loss(result, ctx.groups), _exit_flags(run), checks=result.has_loss)
    if run.cfg.training.calculate_per_token_loss:
        # The gradients are sums of token-loss gradients over every microbatch and rank; the
        # reduction just counted the global batch's loss tokens (megatron-core clamps to 1 too).
        schedule.scale_gradients(1.0 / max(reduced.count, 1.0))
    if run.hooks.after_backward is not None:
        run.hooks.after_backward(iteration, schedule)
    faults.set_phase("optimizer step", iteration)
    if reduced.bad:
        _on_nan_loss(run, iteration, values, result.has_loss)
    stepped, grad_norm, num_zeros = False, None, None
    if not reduced.bad or not run.cfg.training.check_for_nan_in_loss_and_grad:
        stepped, grad_norm, num_zeros = _step_optimizer(run, iteration)
    if stepped:  # Megatron-LM's increment: this iteration's samples
        run.scheduler.step(increment=run.batch_sizes.global_batch_size)
    run.housekeeping.after_optimizer_step(stepped)
    return _outcome(reduced, stepped, grad_norm, num_zeros)


def _exit_flags(run: TrainingRun) -> list[float]:
    """[SIGTERM seen here, rank 0's clock past --exit-duration-in-mins], summed over ranks."""
    limit = run.cfg.training.exit_duration_in_mins
    timed_out = limit is not None and (time.time() - run.start_time) / 60.0 > limit
    return [float(run.exit_signal.received), float(timed_out and dist.get_rank() == 0)]


def _on_nan_loss(run: TrainingRun, iteration: int, values, has_loss: bool) -> None:
    """Name the first bad microbatch (every rank takes part), then warn or raise as configured."""
    rank, mb = first_bad_microbatch(run.ctx, values, has_loss)
    msg = f"NaN/Inf lm loss at iteration {iteration} on rank {rank}, microbatch {mb} of that rank"
    t = run.cfg.training
    if not t.check_for_nan_in_loss_and_grad:
        return
    if not t.skip_nan_steps:
        raise nan_error(msg)
    print_rank_0(f"WARNING: {msg}: step skipped")


def _step_optimizer(run: TrainingRun, iteration: int) -> tuple[bool, Optional[float], Optional[float]]:
    """The optimizer step; a NaN/Inf gradient norm vetoes it, then warns or raises as configured.
    Zeros are counted only for a log line that shows them (the count reads a value back)."""
    t, log = run.cfg.training, run.cfg.logging
    count_zeros = log.log_num_zeros_in_grad and iteration % log.log_interval == 0
    with run.schedule.trace_span("optimizer"):
        stepped, grad_norm, num_zeros = optimizer_step(run.optimizer, t.clip_grad, count_zeros)
    if grad_norm is not None and not math.isfinite(grad_norm) and t.check_for_nan_in_loss_and_grad:
        msg = f"NaN/Inf gradient norm at iteration {iteration}"
        if not t.skip_nan_steps:
            raise nan_error(msg)
        print_rank_0(f"WARNING: {msg}: step skipped")
    return stepped, grad_norm, num_zeros


def _outcome(reduced: ReducedLosses, stepped: bool, grad_norm: Optional[float],
             num_zeros: Optional[float]) -> StepOutcome:
    signal_received, duration_passed = reduced.flags
    mean = reduced.mean
    return StepOutcome(
        loss=mean if mean is not None else float("nan"),
        grad_norm=grad_norm,
        stepped=stepped,
        nan=bool(reduced.bad) or (grad_norm is not None and not math.isfinite(grad_norm)),
        signal_received=bool(signal_received),
        duration_passed=bool(duration_passed),
        num_zeros=num_zeros,
    )


def optimizer_step(optimizer, clip_grad: float,
                   count_zeros: bool = False) -> tuple[bool, Optional[float], Optional[float]]:
    """megatron-core's ChainedOptimizer.step, split so a NaN/Inf norm can veto the update: the
    same (stepped, grad norm, zeros in the clipped gradients or None) it returns."""
    from megatron_weipipe.training.optimizer import clip_grads_by_norm

    found_inf = optimizer.prepare_grads()
    if found_inf:  # fp16 loss-scale overflow: megatron-core's own skip
        return False, None, None
    grad_norm = optimizer.get_grad_norm()
    if grad_norm is None or not math.isfinite(grad_norm):
        return False, float("nan"), None
    if clip_grad > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params and not getattr(opt, "is_stub_optimizer", False):
                clip_grads_by_norm(params, clip_grad, grad_norm,
                                   decoupled=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    num_zeros = optimizer.count_zeros() if count_zeros else None
    return optimizer.step_with_ready_grads(), grad_norm, num_zeros


def nan_error(msg: str) -> NaNError:
    """Every rank raises the same NaNError; rank 0 prints it."""
    e = NaNError(msg)
    e.quiet = dist.get_rank() != 0
    return e
