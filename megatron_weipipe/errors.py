"""Input that cannot work: the exceptions (start-up's, and the simulator's, a kind of it),
the exit status, and the rank that reports it."""

from __future__ import annotations

import os

EXIT_CONFIG = 2  # the exit status of bad flags or inputs, found before training starts


def launcher_rank() -> int:
    """This process's global rank as torchrun gives it (RANK), known before any process
    group exists; 0 when run alone. Start-up errors are printed by rank 0 only."""
    return int(os.environ.get("RANK", "0"))


class ConfigError(ValueError):
    """A flag value or combination that cannot work; the message names the flag and the rule."""


def require(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless ``cond``: one sentence, before any process group exists."""
    if not cond:
        raise ConfigError(msg)


class SimulatorError(ConfigError):
    """An input the simulator cannot simulate; the message is one sentence naming the flag.

    A ConfigError, so that the training rules the simulator applies and its own fail the
    same way."""


def require_simulable(cond: bool, msg: str) -> None:
    """Raise SimulatorError(msg) unless ``cond``."""
    if not cond:
        raise SimulatorError(msg)
