"""Time a schedule from its action lists alone (the tick simulator).

Model (the same for WeiPipe and for the Megatron 1F1B timelines, so bubble fractions
compare): every rank executes its list in order; a compute action takes its cost
(default F = 1, B = 2, split backward I = W = 1, loss 0); SEND is asynchronous and
RECV completes when the matching SEND was issued plus `comm_time` (default 0, i.e.
transfers hidden). Since WeiPipe lists put each SEND right after the last use of the
buffer in its tick, a hop leaves when the sender is done with it; that, not a global
barrier, paces the ring.

It is the event core (replay.py) with every receive posted up front, no wire time and
`comm_time` as each message's latency; the cluster simulator (simulator/cluster_replay.py)
runs the same core with real costs, links and posting rules. Times are exact for costs
that are binary fractions (the defaults, unit costs); for others the core's
remaining-work bookkeeping can differ from a plain running sum in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron_weipipe.schedules.ir.actions import Action, Kind, Schedule
from megatron_weipipe.schedules.timing.replay import ReplayModel, TimedAction, Wire, replay

DEFAULT_COSTS: Mapping[Kind, float] = {
    Kind.FORWARD: 1.0,
    Kind.BACKWARD: 2.0,
    Kind.BACKWARD_INPUT: 1.0,
    Kind.BACKWARD_WEIGHT: 1.0,
    Kind.LOSS: 0.0,
}


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
    """Start and end of every action (a RECV starts and ends when its data is there),
    the makespan and each rank's busy time."""

    def wire(send: Action, src: int, dst: int) -> Wire:
        return Wire(0, "", 0.0, comm_time(send) if comm_time else 0.0)

    trace = replay(schedule, ReplayModel(duration=lambda a: costs.get(a.kind, 0.0), wire=wire, lookahead=None))
    per_rank = tuple(
        tuple(TimedAction(t.action, t.end, t.end) if t.action.kind is Kind.RECV else t for t in timed)
        for timed in trace.per_rank
    )
    makespan = max((timed[-1].end if timed else 0.0 for timed in per_rank), default=0.0)
    return Timing(per_rank, makespan, trace.work)
