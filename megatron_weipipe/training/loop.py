"""The training loop: step, count, log, validate, save, and decide when to stop."""

from __future__ import annotations

import time
from typing import Optional

from megatron_weipipe import faults
from megatron_weipipe.training.checkpoint.checkpointing import save_checkpoint
from megatron_weipipe.training.console import print_rank_0
from megatron_weipipe.training.evaluation import run_validation
from megatron_weipipe.training.iteration_log import LogWindow, log_iteration
from megatron_weipipe.training.loop_state import TrainingRun, TrainState
from megatron_weipipe.training.profiling import StepProfiler
from megatron_weipipe.training.step import StepOutcome, train_step


def train(run: TrainingRun, state: TrainState) -> None:
    """Iterate until the run's last iteration or an exit request; then the closing validation and save."""
    housekeeping = run.housekeeping
    housekeeping.start()
    try:
        _iterate(run, state)
        housekeeping.stop()
        finish(run, state)
    finally:
        housekeeping.restore()


def _iterate(run: TrainingRun, state: TrainState) -> None:
    t = run.cfg.training
    window = LogWindow()
    profiler = StepProfiler.for_run(run.cfg.logging, run.ctx.platform)
    num_microbatches = run.batch_sizes.num_microbatches
    while state.iteration < run.train_iters and not t.skip_train:
        publish_finished_saves(run)
        num_microbatches = update_batch_size(run, state, num_microbatches, window)
        profiler.before_iteration(state.iteration)
        outcome = train_step(run, state.iteration + 1)
        count_iteration(state, outcome, run.batch_sizes.global_batch_size)
        profiler.after_iteration(state.iteration)
        window.add(outcome, run.batch_sizes.global_batch_size)
        if state.iteration % run.cfg.logging.log_interval == 0:
            log_iteration(run, state, outcome, window)
        if run.valid_iter is not None and state.iteration % t.eval_interval == 0:
            faults.set_phase("validation", state.iteration)
            run_validation(run, state)
        run.housekeeping.after_iteration(state.iteration)
        reason = exit_reason(run, state.iteration, outcome)
        if save_due(run, state.iteration, reason):
            save(run, state)
            window.restart_clock()
        if reason:
            announce_exit(run, state, reason)
            break
    profiler.close()


def update_batch_size(run: TrainingRun, state: TrainState, num_microbatches: int, window: LogWindow) -> int:
    """Megatron-LM's top of an iteration: megatron-core's calculator at the samples consumed; when
    the count of microbatches changes, a line and (with --save) a checkpoint first, as Megatron-LM saves."""
    batches = run.batch_sizes
    batches.update(state.consumed_train_samples, consistency_check=False)
    if batches.num_microbatches != num_microbatches and state.iteration != 0:
        print_rank_0(f"> global batch size {batches.global_batch_size} ({batches.num_microbatches} microbatches "
                     f"per replica) from iteration {state.iteration + 1}, {state.consumed_train_samples} samples "
                     "consumed")
        if run.cfg.checkpoint.save and state.last_saved_iteration != state.iteration:
            save(run, state)
            window.restart_clock()
    batches.update(state.consumed_train_samples, consistency_check=True)
    return batches.num_microbatches


def count_iteration(state: TrainState, outcome: StepOutcome, global_batch_size: int) -> None:
    if not outcome.stepped:
        state.skipped_iterations += 1
        if outcome.nan:
            state.nan_iterations += 1
    state.iteration += 1
    state.consumed_train_samples += global_batch_size
    state.losses.append(outcome.loss)
    state.grad_norms.append(outcome.grad_norm if outcome.grad_norm is not None else float("nan"))


def exit_reason(run: TrainingRun, iteration: int, outcome: StepOutcome) -> Optional[str]:
    """Why the run stops after this iteration ("signal", "duration", "interval"), or None."""
    if outcome.signal_received:
        return "signal"
    if outcome.duration_passed:
        return "duration"
    interval = run.cfg.training.exit_interval
    if interval and iteration % interval == 0:
        return "interval"
    return None


def save_due(run: TrainingRun, iteration: int, reason: Optional[str]) -> bool:
    """A checkpoint now: at every ``--save-interval`` and before any exit, if there is ``--save``."""
    c = run.cfg.checkpoint
    return bool(c.save and (reason or (c.save_interval and iteration % c.save_interval == 0)))


def announce_exit(run: TrainingRun, state: TrainState, reason: str) -> None:
    t, save_dir = run.cfg.training, run.cfg.checkpoint.save
    state.exit_reason = reason
    what = {"signal": "SIGTERM received", "duration": f"--exit-duration-in-mins {t.exit_duration_in_mins}",
            "interval": f"--exit-interval {t.exit_interval}"}[reason]
    where = f"checkpoint in {save_dir}" if save_dir else "no --save, nothing saved"
    print_rank_0(f"> exiting at iteration {state.iteration} ({reason}: {what}; {where})")


def finish(run: TrainingRun, state: TrainState) -> None:
    """``--skip-train`` still evaluates (as Megatron-LM does); the last iteration is always saved."""
    if run.cfg.training.skip_train and run.valid_iter is not None:
        faults.set_phase("validation", state.iteration)
        run_validation(run, state)
    if run.cfg.checkpoint.save and state.iteration > 0 and state.last_saved_iteration != state.iteration:
        save(run, state)
    if run.async_saves is not None:
        wait_for_saves(run, "before exiting")
        run.async_saves.close()
    faults.set_phase("shutdown", state.iteration)


def save(run: TrainingRun, state: TrainState) -> None:
    """Save the model, optimizer, scheduler and the loop's counters; print where they went."""
    if run.async_saves is not None:
        wait_for_saves(run, "before the next save")
    faults.set_phase("checkpoint save", state.iteration)
    run.housekeeping.before_save()
    t0 = time.time()
    path, written = save_checkpoint(
        run.cfg,
        run.ctx,
        state.iteration,
        run.model_chunks,
        run.optimizer,
        run.scheduler,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        num_skipped_iterations=state.skipped_iterations,
        background=run.async_saves,
    )
    state.last_saved_iteration = state.iteration
    if not written:
        print_rank_0(f"  checkpoint at iteration {state.iteration:7d} is already published in {path}; not rewritten")
    elif run.async_saves is not None:
        print_rank_0(f"  started an async checkpoint save at iteration {state.iteration:7d} to {path} "
                     f"[ t {time.time() - t0:.2f}s in the training loop; published once every rank has written it ]")
    else:
        print_rank_0(f"  successfully saved checkpoint at iteration {state.iteration:7d} to {path} "
                     f"[ t {time.time() - t0:.2f}s ]")


def publish_finished_saves(run: TrainingRun) -> None:
    """At an iteration boundary: publish the async saves every rank has finished writing, without waiting."""
    if run.async_saves is not None and run.async_saves.in_flight is not None:
        _report_published(run.async_saves.finalize_finished())


def wait_for_saves(run: TrainingRun, why: str) -> None:
    """Wait for the async save in flight (every rank's writer) and publish it."""
    pending = run.async_saves.in_flight
    if pending is None:
        return
    faults.set_phase("checkpoint save", pending.iteration)
    print_rank_0(f"  waiting for the async checkpoint save of iteration {pending.iteration} {why}")
    _report_published(run.async_saves.wait())


def _report_published(saves) -> None:
    for done in saves:
        print_rank_0(f"  successfully saved checkpoint at iteration {done.iteration:7d} to {done.path} "
                     f"[ async: published {time.time() - done.started:.2f}s after it started ]")
