"""The one exception the simulator raises for bad input."""


class SimulatorError(ValueError):
    """An input that cannot be simulated; the message is one sentence naming the flag."""


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise SimulatorError(msg)
