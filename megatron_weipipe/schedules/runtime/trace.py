"""Per-rank timestamps of every schedule action, written as Chrome trace JSON.

One file per global rank (`rank{N}.json`: the trace-event JSON array that Perfetto and
chrome://tracing open). The file is valid JSON after every iteration and grows by
appending (no rewrite), so a long run can keep the flag on. Every event is a complete
event (`ph: "X"`) with a category:

- `iteration`: one training iteration's forward and backward (the optimizer step is
  outside it, as its own `optimizer` event); `args.iteration` numbers them from 1;
- `compute`: forward, loss, backward, backward-input, backward-weight work;
- `wait`: a receive being waited for; `send`: a send being posted;
- `other`: buffer bookkeeping (load, drop, gradient start/accumulate).

Timestamps are wall-clock microseconds, so the files of the ranks of one host line up.
What times a span is the clock the tracer is given (trace_clock.py): host time on a CPU
host (compute time there), CUDA events on the current stream on a GPU (host time there
would show kernel launches and free receives). Event times are resolved when the file is
written at the end of each iteration, with one synchronisation on an anchor event (only
while tracing); the optimizer step's events are resolved at the next iteration's write
(or by `close()`, also run at exit). A metadata event `schedule_trace` (`ph: "M"`,
appended after every write; the last one counts) carries the schedule name, the rank,
the clock (`clock`: "host" or "cuda_event") and what the plan needs (pipeline size,
microbatches, ...). `tools/schedule_timeline.py --from-trace DIR` reads them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import weakref
from typing import Iterator, Optional

from .trace_clock import HostClock

COMPUTE = {"forward", "loss", "backward", "backward_input", "backward_weight"}
WAIT = {"recv"}
SEND = {"send"}

log = logging.getLogger(__name__)


def category(kind: str) -> str:
    if kind in COMPUTE:
        return "compute"
    if kind in WAIT:
        return "wait"
    if kind in SEND:
        return "send"
    return "other"


def _close_at_exit(ref) -> None:
    """Best effort: a device already gone at exit loses the last optimizer event only."""
    tracer = ref()
    if tracer is not None:
        try:
            tracer.close()
        except Exception as e:  # noqa: BLE001
            log.warning("schedule trace %s: last events not written at exit (%s)", tracer.path, e)


class ActionTracer:
    """Collects one rank's events and writes them to `directory/rank{rank}.json`.

    `clock` (trace_clock.py; host time by default) times every span."""

    def __init__(self, directory: str, rank: int, schedule: str, meta: Optional[dict] = None, clock=None):
        self.path = os.path.join(directory, f"rank{rank}.json")
        self.rank = rank
        self.schedule = schedule
        self.clock = clock if clock is not None else HostClock()
        self.meta = dict(meta or {})  # e.g. pipeline_size, num_microbatches: what the plan needs
        self.pending: list[tuple[dict, object, object]] = []  # (event without ts/dur, start mark, end mark)
        self.iteration = 0
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w") as f:
            f.write("[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                                        "args": {"name": f"rank {rank}"}}) + "\n]")
        self._written = os.path.getsize(self.path)  # the file's size after our last write
        atexit.register(_close_at_exit, weakref.ref(self))

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                     "args": {"iteration": self.iteration, **args}}
            self.pending.append((event, start, self.clock.mark()))

    @contextlib.contextmanager
    def action(self, a) -> Iterator[None]:
        """One runtime action (a plan `Action`)."""
        kind = a.kind.value
        args = {"tick": a.tick, "chunk": a.chunk}
        if a.mb >= 0:
            args["mb"] = a.mb
        if a.flow is not None:
            args["peer"] = a.peer
            args["flow"] = a.flow.value
        with self.span(kind, category(kind), **args):
            yield

    @contextlib.contextmanager
    def iteration_span(self) -> Iterator[None]:
        """Around one iteration's forward and backward; its end writes the file, waiting for
        the device (the training loop reads the losses to the host right after anyway)."""
        self.iteration += 1
        with self.span("iteration", "iteration"):
            yield
        self.write(wait=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A traced phase outside the schedule (the optimizer step), timed like the actions;
        written now where the clock need not wait for the device, else with the next write."""
        with self.span(name, name):
            yield
        self.write(wait=False)

    def close(self) -> None:
        """Write what is still pending (a CUDA clock's last optimizer step), unless another
        tracer has rewritten the file since (a second run in this process)."""
        if self.pending and os.path.exists(self.path) and os.path.getsize(self.path) == self._written:
            self.write(wait=True)

    def write(self, wait: bool = True) -> None:
        """Append the events since the last write and the metadata; the file stays one
        valid JSON array (its closing bracket is overwritten and written again). Without
        `wait`, nothing is written if the clock cannot resolve its marks yet."""
        marks = [m for _, start, end in self.pending for m in (start, end)]
        times = self.clock.resolve(marks, wait)
        if times is None:
            return
        events = []
        for i, (event, _, _) in enumerate(self.pending):
            start, end = times[2 * i], times[2 * i + 1]
            events.append({**event, "ts": start, "dur": end - start})
        meta = {"name": "schedule_trace", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {**self.meta, "schedule": self.schedule, "rank": self.rank, "clock": self.clock.name}}
        text = "".join(",\n" + json.dumps(e) for e in events + [meta])
        with open(self.path, "r+") as f:
            f.seek(0, os.SEEK_END)
            f.seek(f.tell() - 2)  # before the closing "\n]"
            f.write(text + "\n]")
            self._written = f.tell()
        self.pending.clear()
