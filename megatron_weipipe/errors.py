"""The one exception for input that cannot work, shared by start-up and the simulator."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag value or combination that cannot work; the message names the flag and the rule."""


def require(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless ``cond``: one sentence, before any process group exists."""
    if not cond:
        raise ConfigError(msg)
