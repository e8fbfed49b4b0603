"""The clocks a schedule trace can be timed with: host time or CUDA events.

On a CPU host the host's wall clock is compute time. On a GPU it is not: kernels are
enqueued asynchronously, so host time around a compute action is its launch time, and
NCCL's ``work.wait()`` makes the current stream wait without blocking the host, so a
receive looks free. ``CudaEventClock`` records a CUDA event on the current stream at each
mark instead and turns the events into wall-clock microseconds only when asked to wait
(once per iteration): it records one anchor event, synchronises on it and reads the
host's clock right after, so every event's time is the anchor's wall time minus the
device time between them. The ranks of one host then still share one time axis.

``mark()`` returns an opaque token; ``resolve(marks, wait)`` turns tokens into wall-clock
microseconds, or returns None when it cannot without waiting for the device (then the
tokens stay valid for a later call).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from megatron_weipipe.schedules.timing.measured import CUDA_EVENT, HOST  # the clock names, where the trace's readers keep them

log = logging.getLogger(__name__)


class HostClock:
    """time.time_ns at each mark: compute time on a CPU host; launch time on a GPU."""

    name = HOST

    def mark(self) -> float:
        return time.time_ns() / 1000.0

    def resolve(self, marks: list, wait: bool) -> Optional[list[float]]:
        return list(marks)


class CudaEventClock:
    """A timing CUDA event recorded on the current stream at each mark.

    `new_event` makes one (``torch.cuda.Event(enable_timing=True)`` by default; tests pass
    fakes). Resolved events are reused, so a long run does not create events per action.
    """

    name = CUDA_EVENT

    def __init__(self, new_event: Optional[Callable[[], object]] = None):
        if new_event is None:
            import torch

            def new_event():
                return torch.cuda.Event(enable_timing=True)
        self._new = new_event
        self._free: list = []

    def mark(self):
        event = self._free.pop() if self._free else self._new()
        event.record()  # on the current stream: done when the work enqueued before it is
        return event

    def resolve(self, marks: list, wait: bool) -> Optional[list[float]]:
        if not marks:
            return []
        if not wait:
            return None
        anchor = self.mark()
        anchor.synchronize()  # the tracer's one host sync per iteration
        now_us = time.time_ns() / 1000.0
        out = [now_us - e.elapsed_time(anchor) * 1000.0 for e in marks]  # elapsed_time is in ms
        self._free.extend(marks)
        self._free.append(anchor)
        return out


def clock_for(platform) -> "HostClock | CudaEventClock":
    """CUDA events where the platform is CUDA and they work (probed once, here), else host
    time. A CUDA platform that falls back says so in one logged line, and the trace's
    metadata names the clock, so its readers can warn."""
    if not platform.is_cuda:
        return HostClock()
    try:
        clock = CudaEventClock()
        clock.resolve([clock.mark()], wait=True)
        return clock
    except Exception as e:  # noqa: BLE001 - any failure means: no usable events here
        log.warning("schedule trace: CUDA events unusable (%s); timing with host time, which on a GPU "
                    "measures launches, not kernels", e)
        return HostClock()
