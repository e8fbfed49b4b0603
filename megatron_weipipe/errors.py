"""The exceptions for input that cannot work: start-up's, and the simulator's (a kind of it)."""

from __future__ import annotations


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
