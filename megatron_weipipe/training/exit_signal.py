"""SIGTERM as a request to stop: finish the iteration, save, exit cleanly."""

from __future__ import annotations

import signal


class ExitSignal:
    """Remembers a SIGTERM so the run can finish its iteration, save and exit cleanly.

    Installed before anything slow, so a preemption notice that arrives during start-up
    is honoured at the end of the first iteration instead of killing the rank.
    """

    def __init__(self, enabled: bool):
        self.received = False
        self._previous = None
        if enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
