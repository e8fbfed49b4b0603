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

Timestamps are wall-clock microseconds (time.time_ns), so the files of the ranks of one
host line up. A metadata event `schedule_trace` (`ph: "M"`, appended after every
iteration; the last one counts) carries the schedule name, the rank and what the plan
needs (pipeline size, microbatches, ...). `tools/schedule_timeline.py --from-trace DIR` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator, Optional

COMPUTE = {"forward", "loss", "backward", "backward_input", "backward_weight"}
WAIT = {"recv"}
SEND = {"send"}


def category(kind: str) -> str:
    if kind in COMPUTE:
        return "compute"
    if kind in WAIT:
        return "wait"
    if kind in SEND:
        return "send"
    return "other"


def _now_us() -> float:
    return time.time_ns() / 1000.0


class ActionTracer:
    """Collects one rank's events and writes them to `directory/rank{rank}.json`."""

    def __init__(self, directory: str, rank: int, schedule: str, meta: Optional[dict] = None):
        self.path = os.path.join(directory, f"rank{rank}.json")
        self.rank = rank
        self.schedule = schedule
        self.meta = dict(meta or {})  # e.g. pipeline_size, num_microbatches: what the plan needs
        self.events: list[dict] = []  # not yet written
        self.iteration = 0
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w") as f:
            f.write("[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                                        "args": {"name": f"rank {rank}"}}) + "\n]")

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        start = _now_us()
        try:
            yield
        finally:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": _now_us() - start,
                                "pid": self.rank, "tid": 0, "args": {"iteration": self.iteration, **args}})

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
        self.iteration += 1
        with self.span("iteration", "iteration"):
            yield
        self.write()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A traced phase outside the schedule (the optimizer step); the file is rewritten after it."""
        with self.span(name, name):
            yield
        self.write()

    def write(self) -> None:
        """Append the events since the last write and the metadata; the file stays one
        valid JSON array (its closing bracket is overwritten and written again)."""
        meta = {"name": "schedule_trace", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {**self.meta, "schedule": self.schedule, "rank": self.rank}}
        text = "".join(",\n" + json.dumps(e) for e in self.events + [meta])
        with open(self.path, "r+") as f:
            f.seek(0, os.SEEK_END)
            f.seek(f.tell() - 2)  # before the closing "\n]"
            f.write(text + "\n]")
        self.events.clear()
