"""What this rank is doing, and test hooks that make faults happen on purpose.

The phase ("forward/backward at iteration 12", "checkpoint save", ...) is a plain
module-level value the training loop updates; the watchdog publishes it so that a
failure message can say what a rank was doing when it died, even after a SIGKILL.

Fault injection is driven by environment variables read once per run (``configure``),
so tests can break real processes started by torchrun without new command-line flags:

- ``MEGATRON_WEIPIPE_INJECT_NAN="iteration:rank:microbatch"`` makes that microbatch's
  loss NaN (and so its gradients), on that global rank, in that training iteration.
  The microbatch index counts the loss computations of that rank in the iteration, so
  it means the same under every schedule that computes its loss with ``gpt_step``.
- ``MEGATRON_WEIPIPE_TEST_SLOW_SAVE="seconds[:iteration]"`` pauses the save (of that
  iteration, or every save) after the shards are written and before the checkpoint is
  published, so a test can kill a rank there.
- ``MEGATRON_WEIPIPE_TEST_RAISE="iteration:rank"`` raises a RuntimeError on that rank at
  the start of that iteration's forward/backward (a rank failing alone).
- ``MEGATRON_WEIPIPE_TEST_HOLD_ASYNC_WRITE="release-file[:iteration]"`` holds the background
  writer of an ``--async-save`` (of that iteration, or every one) before it writes anything,
  until ``release-file`` exists: training goes on meanwhile, so a test can run optimizer
  steps, send SIGTERM or SIGKILL while the save is in flight.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

NAN_ENV = "MEGATRON_WEIPIPE_INJECT_NAN"
SLOW_SAVE_ENV = "MEGATRON_WEIPIPE_TEST_SLOW_SAVE"
RAISE_ENV = "MEGATRON_WEIPIPE_TEST_RAISE"
HOLD_WRITE_ENV = "MEGATRON_WEIPIPE_TEST_HOLD_ASYNC_WRITE"
_HOLD_LIMIT_S = 600.0  # a held writer never outlives a forgotten test by more than this

TRAIN_STEP = "forward/backward"


@dataclass
class _State:
    phase: str = "start-up"
    iteration: Optional[int] = None
    losses_this_iteration: int = 0
    nan_target: Optional[tuple[int, int, int]] = None
    slow_save_seconds: float = 0.0
    slow_save_iteration: Optional[int] = None
    raise_at: Optional[tuple[int, int]] = None
    hold_write_file: Optional[str] = None
    hold_write_iteration: Optional[int] = None
    failing: bool = False  # this rank is already on its way out with its own error


_state = _State()


def set_phase(phase: str, iteration: Optional[int] = None) -> None:
    """Record what this rank does now; a new iteration restarts the microbatch count."""
    if iteration != _state.iteration:
        _state.losses_this_iteration = 0
    _state.phase = phase
    _state.iteration = iteration
    if phase == TRAIN_STEP and _state.raise_at is not None and _state.raise_at == (iteration, _global_rank()):
        raise RuntimeError(f"injected failure ({RAISE_ENV}) at iteration {iteration}")


def describe_phase() -> str:
    if _state.iteration is None:
        return _state.phase
    return f"{_state.phase} at iteration {_state.iteration}"


def mark_failing() -> None:
    _state.failing = True


def is_failing() -> bool:
    return _state.failing


def _parse_nan_target(text: str) -> tuple[int, int, int]:
    try:
        it, rank, mb = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{NAN_ENV}={text!r}: expected 'iteration:rank:microbatch', e.g. '3:1:0'") from None
    return it, rank, mb


def configure(environ=os.environ) -> None:
    """Read the fault-injection variables (once per run) and reset the phase."""
    text = environ.get(NAN_ENV, "").strip()
    _state.nan_target = _parse_nan_target(text) if text else None
    seconds, _, at = environ.get(SLOW_SAVE_ENV, "").partition(":")
    _state.slow_save_seconds = float(seconds or 0)
    _state.slow_save_iteration = int(at) if at else None
    text = environ.get(RAISE_ENV, "").strip()
    try:
        _state.raise_at = tuple(int(x) for x in text.split(":")) if text else None
    except ValueError:
        raise ValueError(f"{RAISE_ENV}={text!r}: expected 'iteration:rank'") from None
    text = environ.get(HOLD_WRITE_ENV, "").strip()
    path, sep, at = text.rpartition(":")
    if not sep or not at.isdigit():  # no ":iteration": every save is held
        path, at = text, ""
    _state.hold_write_file = path or None
    _state.hold_write_iteration = int(at) if at else None
    _state.phase, _state.iteration, _state.losses_this_iteration = "start-up", None, 0
    _state.failing = False


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def maybe_inject_nan(loss: torch.Tensor) -> torch.Tensor:
    """Count this loss computation; return a NaN loss if it is the injected one.

    Multiplying (not adding) keeps the NaN in the backward pass, as a real overflow would.
    """
    if _state.phase != TRAIN_STEP:
        return loss
    index = _state.losses_this_iteration
    _state.losses_this_iteration += 1
    target = _state.nan_target
    if target is None or (_state.iteration, _global_rank(), index) != target:
        return loss
    return loss * torch.tensor(float("nan"), dtype=loss.dtype, device=loss.device)


def pause_inside_save(iteration: int) -> None:
    """Test hook: stay inside an unpublished save long enough to be killed there."""
    if _state.slow_save_seconds > 0 and _state.slow_save_iteration in (None, iteration):
        print(f"  [test hook] rank {_global_rank()} pausing {_state.slow_save_seconds:g}s inside the save "
              f"of iteration {iteration}", flush=True)
        time.sleep(_state.slow_save_seconds)


def hold_background_write(iteration: int) -> None:
    """Test hook, in an ``--async-save`` writer process: wait for the release file before writing."""
    path = _state.hold_write_file
    if path is None or _state.hold_write_iteration not in (None, iteration):
        return
    print(f"  [test hook] rank {_global_rank()} holding the background write of iteration {iteration} "
          f"until {path} exists", flush=True)
    deadline = time.monotonic() + _HOLD_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
