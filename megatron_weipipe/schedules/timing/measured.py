"""Busy, idle and bubble measured from `--schedule-trace` files (Chrome trace JSON).

Pure Python, like the rest of the schedule data. The measured bubble is idle / (busy +
idle) summed over all ranks, over every traced iteration except the first (warm-up: allocation,
first-touch), excluding the optimizer step. An iteration's window is the same for all
ranks: from the earliest start to the latest end of that iteration's `iteration` event
on any rank (timestamps are wall-clock, so this holds for ranks of one host). The
metadata's `clock` says what timed the spans: "host" (time.time_ns; compute time on a
CPU host, kernel launches on a GPU) or "cuda_event" (the device's stream); files without
one are host-timed. One directory must not mix clocks, and host time from a CUDA run is
flagged (`Measured.clock_warning`). A rank is
busy while a `compute` event runs (forward, loss, backward, backward-input,
backward-weight; Megatron's forward_step / backward_step) and idle for the rest of the
window: waiting for a message, posting one, buffer bookkeeping, gradient reductions.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from statistics import mean
from typing import Optional

HOST, CUDA_EVENT = "host", "cuda_event"  # the trace metadata's `clock` values (runtime/trace_clock.py)

# The action kinds of ir/actions.py whose cost the simulator models.
COST_KINDS = ("forward", "backward", "backward_input", "backward_weight", "loss")


@dataclass
class RankTrace:
    rank: int
    schedule: str
    meta: dict
    events: list[dict]  # complete events ("ph": "X"), ts/dur in microseconds

    @property
    def clock(self) -> str:
        return str(self.meta.get("clock", HOST))  # files written before the clock was recorded: host time


@dataclass
class RankMeasure:
    rank: int
    busy_s: float = 0.0
    idle_s: float = 0.0
    # where the idle time went: waiting for receives, posting sends, buffer bookkeeping;
    # the rest of idle_s is outside any action (ring all-reduce of replicated gradients,
    # Python between actions, the wait for the slowest rank at the iteration's edges)
    wait_s: float = 0.0
    send_s: float = 0.0
    other_s: float = 0.0


@dataclass
class Measured:
    schedule: str
    meta: dict
    iterations: list[int]  # the iterations measured (all but the first)
    ranks: list[RankMeasure]
    mean_cost_s: dict[str, float] = field(default_factory=dict)  # per compute kind, mean duration
    iteration_s: list[float] = field(default_factory=list)  # window length per measured iteration
    clock: str = HOST  # what timed the spans (all ranks share it)

    @property
    def clock_warning(self) -> Optional[str]:
        """Set where a CUDA run was timed with host time: its compute costs are launch times
        and its receive waits look free, so neither calibrates a GPU."""
        if self.clock == HOST and self.meta.get("device_type") == "cuda":
            return ("traced with host time on a CUDA run: compute is kernel-launch time and receives "
                    "look free; not a calibration of the GPU")
        return None

    @property
    def busy_s(self) -> float:
        return sum(r.busy_s for r in self.ranks)

    @property
    def idle_s(self) -> float:
        return sum(r.idle_s for r in self.ranks)

    @property
    def measured_bubble(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "meta": self.meta,
            "iterations": self.iterations,
            "measured_bubble": self.measured_bubble,
            "mean_iteration_s": mean(self.iteration_s) if self.iteration_s else None,
            "mean_cost_s": self.mean_cost_s,
            "clock": self.clock,
            "clock_warning": self.clock_warning,
            "ranks": [{"rank": r.rank, "busy_s": r.busy_s, "idle_s": r.idle_s, "wait_s": r.wait_s,
                       "send_s": r.send_s, "other_s": r.other_s} for r in self.ranks],
        }


class TraceError(ValueError):
    pass


def load(directory: str) -> list[RankTrace]:
    paths = sorted(glob.glob(os.path.join(directory, "rank*.json")))
    if not paths:
        raise TraceError(f"no rank*.json trace files in {directory}")
    out = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            if isinstance(data, list):  # what --schedule-trace writes: the JSON array format
                metas = [e["args"] for e in data if e.get("ph") == "M" and e.get("name") == "schedule_trace"]
                other, raw = (metas[-1] if metas else {}), data
            else:  # the object format ({"traceEvents": [...], "otherData": {...}})
                other, raw = data.get("otherData", {}), data["traceEvents"]
            events = [e for e in raw if e.get("ph") == "X"]
            out.append(RankTrace(int(other["rank"]), str(other["schedule"]), dict(other), events))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path} is not a schedule trace: {e}") from None
    names = {t.schedule for t in out}
    if len(names) != 1:
        raise TraceError(f"{directory} mixes traces of schedules {sorted(names)}")
    clocks = {t.clock for t in out}
    if len(clocks) != 1:
        raise TraceError(f"{directory} mixes traces timed by clocks {sorted(clocks)}")
    return sorted(out, key=lambda t: t.rank)


def windows(traces: list[RankTrace]) -> dict[int, tuple[float, float]]:
    """Iteration -> (start, end) in microseconds, over the ranks that traced it."""
    out: dict[int, tuple[float, float]] = {}
    for t in traces:
        for e in t.events:
            if e.get("cat") == "iteration":
                it = e["args"]["iteration"]
                lo, hi = e["ts"], e["ts"] + e["dur"]
                if it in out:
                    lo, hi = min(lo, out[it][0]), max(hi, out[it][1])
                out[it] = (lo, hi)
    return out


def measure(traces: list[RankTrace], skip_first: bool = True) -> Measured:
    win = windows(traces)
    complete = sorted(it for it in win if all(any(e.get("cat") == "iteration" and e["args"]["iteration"] == it
                                                  for e in t.events) for t in traces))
    its = complete[1:] if skip_first else complete
    if not its:
        raise TraceError(f"need at least {2 if skip_first else 1} iterations traced on every rank, "
                         f"found {len(complete)}")
    ranks, costs = [], {}
    for t in traces:
        m = RankMeasure(t.rank)
        for it in its:
            lo, hi = win[it]
            busy = 0.0
            for e in t.events:
                cat = e.get("cat")
                if cat not in ("compute", "wait", "send", "other") or e["args"].get("iteration") != it:
                    continue
                s, f = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
                inside = max(0.0, f - s)
                if cat == "compute":
                    busy += inside
                    costs.setdefault(e["name"], []).append(e["dur"])
                else:
                    setattr(m, f"{cat}_s", getattr(m, f"{cat}_s") + inside / 1e6)
            m.busy_s += busy / 1e6
            m.idle_s += (hi - lo - busy) / 1e6
        ranks.append(m)
    return Measured(traces[0].schedule, traces[0].meta, its, ranks,
                    {k: mean(v) / 1e6 for k, v in sorted(costs.items())},
                    [(win[it][1] - win[it][0]) / 1e6 for it in its], traces[0].clock)


def same_clock(measures: list[Measured]) -> str:
    """The clock of measurements meant to be compared or averaged (a calibration's runs);
    TraceError where they mix host time and CUDA events."""
    clocks = {m.clock for m in measures}
    if len(clocks) != 1:
        raise TraceError(f"measurements timed by different clocks {sorted(clocks)} cannot be combined")
    return clocks.pop()


def between_iterations_s(traces: list[RankTrace]) -> list[float]:
    """Seconds the training loop spends per iteration outside the schedule and the optimizer
    step (reading the next microbatches, zeroing gradients, the per-iteration flag
    all-reduce, logging): on each rank, from one iteration's end to the next one's start,
    less its `optimizer` event between them; the least over ranks, as the rank that ended
    last waits for no other (the others' gaps also hold their wait for it, and their steps
    may overlap its end). One value per consecutive pair after the first iteration
    (warm-up). Meaningful where the ranks end their iterations together (PP = 1, DP > 1)."""
    per_rank = []
    for t in traces:
        win = windows([t])
        opt: dict[int, float] = {}
        for e in t.events:
            if e.get("cat") == "optimizer":
                it = e["args"]["iteration"]
                opt[it] = max(opt.get(it, 0.0), e["dur"])
        its = sorted(win)[1:]
        per_rank.append({a: (win[b][0] - win[a][1] - opt.get(a, 0.0)) / 1e6
                         for a, b in zip(its, its[1:]) if b == a + 1})
    pairs = sorted(set.intersection(*(set(g) for g in per_rank))) if per_rank else []
    return [min(g[a] for g in per_rank) for a in pairs]


def last_window_rows(traces: list[RankTrace], width: int) -> tuple[list[str], float]:
    """Text timeline of the last traced iteration: one row per rank, one character per
    1/width of the window (F forward, L loss, B backward, I input, W weight, . idle)."""
    win = windows(traces)
    it = max(win)
    lo, hi = win[it]
    span = max(hi - lo, 1e-9)
    letters = {"forward": "F", "loss": "L", "backward": "B", "backward_input": "I", "backward_weight": "W"}
    rows = []
    for t in traces:
        cover = [dict() for _ in range(width)]
        for e in t.events:
            if e.get("cat") != "compute" or e["args"].get("iteration") != it:
                continue
            s, f = (e["ts"] - lo) / span * width, (e["ts"] + e["dur"] - lo) / span * width
            for b in range(max(0, int(s)), min(width, int(f) + 1)):
                part = min(f, b + 1) - max(s, b)
                if part > 0:
                    ch = letters.get(e["name"], "C")
                    cover[b][ch] = cover[b].get(ch, 0.0) + part
        rows.append("".join(max(c, key=c.get) if c and sum(c.values()) >= 0.5 else "." for c in cover))
    return rows, span / 1e6
