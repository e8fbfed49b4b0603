"""The exception the simulator raises for input it cannot simulate."""

from megatron_weipipe.errors import ConfigError


class SimulatorError(ConfigError):
    """An input that cannot be simulated; the message is one sentence naming the flag.

    A ConfigError, so that the training rules the simulator applies and its own
    fail the same way."""


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise SimulatorError(msg)
