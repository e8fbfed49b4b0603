"""Time a schedule from its action lists alone.

Model (the same for WeiPipe and for the Megatron 1F1B timelines, so bubble fractions
compare): every rank executes its list in order; a compute action takes its cost
(default F = 1, B = 2, split backward I = W = 1, loss 0); SEND is asynchronous and
RECV completes when the matching SEND was issued plus `comm_time` (default 0, i.e.
transfers hidden). Since WeiPipe lists put each SEND right after the last use of the
buffer in its tick, a hop leaves when the sender is done with it; that, not a global
barrier, paces the ring. A cluster simulator can swap in real costs and a bandwidth
model through the same two arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .actions import COMPUTE_KINDS, Action, Kind, Schedule
from .execution import walk

DEFAULT_COSTS: Mapping[Kind, float] = {
    Kind.FORWARD: 1.0,
    Kind.BACKWARD: 2.0,
    Kind.BACKWARD_INPUT: 1.0,
    Kind.BACKWARD_WEIGHT: 1.0,
    Kind.LOSS: 0.0,
}


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timing:
    per_rank: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    busy: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over total compute capacity (num_ranks x makespan)."""
        total = self.makespan * len(self.busy)
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def simulate(
    schedule: Schedule,
    costs: Mapping[Kind, float] = DEFAULT_COSTS,
    comm_time: Optional[Callable[[Action], float]] = None,
) -> Timing:
    P = schedule.num_ranks
    clock = [0.0] * P
    sent_at: dict[int, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(P)]
    busy = [0.0] * P

    def visit(a: Action, matched: Optional[Action]) -> None:
        start = clock[a.rank]
        if a.kind is Kind.RECV:
            start = max(start, sent_at.pop(id(matched)) + (comm_time(matched) if comm_time else 0.0))
        cost = costs.get(a.kind, 0.0) if a.kind in COMPUTE_KINDS else 0.0
        end = start + cost
        if a.kind is Kind.SEND:
            sent_at[id(a)] = end
        clock[a.rank] = end
        busy[a.rank] += cost
        timed[a.rank].append(TimedAction(a, start, end))

    walk(schedule, visit)
    return Timing(tuple(tuple(t) for t in timed), max(clock) if clock else 0.0, tuple(busy))
