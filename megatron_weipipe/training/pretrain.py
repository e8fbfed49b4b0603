"""The training loop's entry point: Megatron-LM's ``pretrain()`` on megatron-core pieces, schedule-agnostic.

Set-up is run_setup.py, one iteration step.py, the loop around it loop.py; this module
starts the run and turns a failure into the one line each rank reports.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.data.datasets import build_train_valid_test_datasets
from megatron_weipipe.initialize import initialize_distributed
from megatron_weipipe import faults
from megatron_weipipe.schedules.gpt.base import ForwardStep, TrainSchedule
from megatron_weipipe.training.checkpoint.checkpointing import CheckpointError
from megatron_weipipe.training.console import set_logging_level
from megatron_weipipe.training.exit_signal import ExitSignal
from megatron_weipipe.training.loop import train
from megatron_weipipe.training.loop_state import TrainingHooks, TrainState
from megatron_weipipe.training.run_setup import set_up_run
from megatron_weipipe.training.step import NaNError
from megatron_weipipe.training.watchdog import install_child_process_guards, start_watchdog


def pretrain(
    cfg: PretrainConfig,
    model_provider: Callable[..., torch.nn.Module],
    forward_step: ForwardStep,
    datasets_provider: Callable = build_train_valid_test_datasets,
    after_backward: Optional[Callable[[int, TrainSchedule], None]] = None,
    on_log: Optional[Callable[[dict], None]] = None,
) -> TrainState:
    """Train ``cfg.training.iterations`` iterations; returns the final state (losses per iteration).

    ``model_provider(cfg, vocab_size, pre_process, post_process, vp_stage=None)`` builds one
    stage; ``forward_step(data_iterator, model)`` is Megatron-LM's forward step.
    ``after_backward(iteration, schedule)``, if given, sees the reduced gradients of every
    iteration before the optimizer step (tests compare them across schedules).
    ``on_log(stats)``, if given, is called on every rank at each logged iteration with the
    fields of the log line as a dict (``iteration``, ``elapsed_ms``, ``bytes_sent`` ...,
    unrounded), before rank 0 prints the line.

    An exception leaves with ``report`` (the line to print) and ``quiet`` (another rank
    prints the same error) attributes; peers are told through the watchdog and exit.
    """
    start_time = time.time()
    set_logging_level(cfg.logging.logging_level)
    faults.configure()
    exit_signal = ExitSignal(cfg.training.exit_signal_handler)
    install_child_process_guards()
    hooks = TrainingHooks(model_provider, forward_step, datasets_provider, after_backward, on_log)
    watchdog = None
    try:
        ctx = initialize_distributed(cfg)
        watchdog = start_watchdog(cfg.parallel.distributed_timeout_minutes)
        run, state = set_up_run(cfg, ctx, hooks, exit_signal, start_time)
        try:
            train(run, state)
        finally:
            run.writers.close()
        if watchdog is not None:
            watchdog.stop()
            dist.barrier()  # no rank may take the store down while a peer's watchdog still polls it
        return state
    except BaseException as e:
        _describe_failure(e, watchdog)
        raise
    finally:
        exit_signal.restore()


def _describe_failure(e: BaseException, watchdog) -> None:
    """Publish the failure to the peers and attach the one line this rank should print."""
    own = f"failed during {faults.describe_phase()}: {type(e).__name__}: {_first_line(e)}"
    if isinstance(e, (NaNError, CheckpointError, ValueError, FileNotFoundError)):  # self-explanatory
        own = _first_line(e)
    if watchdog is None:
        report = own
    elif hasattr(e, "quiet"):  # raised by every rank together; one of them prints it
        watchdog.leave()
        report = own
    else:
        line = watchdog.report_failure(e)
        report = line if line.startswith("stopping:") else own
    try:
        e.report = report
        if not hasattr(e, "quiet"):
            e.quiet = False
    except AttributeError:
        pass


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
