"""The per-interval training log line, its ``on_log`` hook and its scalars (TensorBoard, W&B)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from megatron_weipipe.training.console import print_rank_0
from megatron_weipipe.training.loop_state import TrainingRun, TrainState
from megatron_weipipe.training.metrics import memory_scalars, training_log_line
from megatron_weipipe.training.params_norm import params_l2_norm
from megatron_weipipe.training.step import StepOutcome


@dataclass
class LogWindow:
    """What the next log line reads: the iterations since the last line, when they started
    (checkpoint saves left out), and the gradient norm of the last step taken."""

    start: float = field(default_factory=time.time)
    iterations: int = 0
    samples: int = 0  # trained since the last line (a ramp's batch sizes differ per iteration)
    global_batch_size: int = 0  # the last iteration's
    last_grad_norm: Optional[float] = None

    def add(self, outcome: StepOutcome, global_batch_size: int) -> None:
        self.iterations += 1
        self.samples += global_batch_size
        self.global_batch_size = global_batch_size
        if outcome.stepped:
            self.last_grad_norm = outcome.grad_norm

    def restart_clock(self) -> None:
        """Keep what just ran (a checkpoint save) out of the throughput."""
        self.start = time.time()

    def restart(self) -> None:
        self.start, self.iterations, self.samples = time.time(), 0, 0


def log_iteration(run: TrainingRun, state: TrainState, outcome: StepOutcome, window: LogWindow) -> None:
    """Print the log line of this iteration (rank 0) after handing its fields to ``on_log`` (every rank)."""
    cfg, t, optimizer = run.cfg, run.cfg.training, run.optimizer
    elapsed = time.time() - window.start
    per_iter = elapsed / window.iterations
    mem, _ = run.ctx.platform.peak_memory_gb()
    lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else t.lr
    stats = dict(
        iteration=state.iteration,
        train_iters=run.train_iters,
        consumed_samples=state.consumed_train_samples,
        elapsed_ms=per_iter * 1000,
        tflops_per_device=run.flops_per_sample * window.samples / elapsed / 1e12 / cfg.world_size,
        tokens_per_second=window.samples * cfg.model.seq_length / elapsed,
        lr=lr,
        global_batch_size=window.global_batch_size,  # this iteration's (a ramp's current one)
        losses={"lm loss": outcome.loss},
        loss_scale=float(optimizer.get_loss_scale().item()),
        grad_norm=outcome.grad_norm if outcome.stepped else None,  # none for a skipped step
        skipped=state.skipped_iterations,
        nan_iterations=state.nan_iterations,
        mem_gb=mem,
        bytes_sent=run.ctx.bytes.snapshot()["sent"],
        num_zeros=outcome.num_zeros,
        params_norm=params_l2_norm(optimizer) if cfg.logging.log_params_norm else None,
    )
    if run.hooks.on_log is not None:
        run.hooks.on_log(stats)
    print_rank_0(training_log_line(**stats))
    run.writers.scalars(state.iteration, tensorboard_scalars(run, stats, outcome, window, per_iter))
    window.restart()


def tensorboard_scalars(run: TrainingRun, stats: dict, outcome: StepOutcome, window: LogWindow,
                        per_iter: float) -> dict[str, float]:
    """The scalars of one log line, under Megatron-LM's TensorBoard (and W&B) names."""
    log = run.cfg.logging
    scalars = {"lm-loss": outcome.loss, "learning-rate": stats["lr"], "grad-norm": window.last_grad_norm or 0.0}
    if stats["num_zeros"] is not None:
        scalars["num-zeros"] = stats["num_zeros"]
    if stats["params_norm"] is not None:
        scalars["params-norm"] = stats["params_norm"]
    if log.log_memory_to_tensorboard:
        scalars.update(memory_scalars(run.ctx.platform))
    if log.log_timers_to_tensorboard:
        scalars.update({"iteration-time": per_iter, "throughput": stats["tflops_per_device"]})
    return scalars
