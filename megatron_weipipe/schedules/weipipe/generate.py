"""WeiPipe compute plans: what each ring rank computes at each tick.

Ticks are 0-indexed. Rank r runs its own G microbatches through all P chunks; the plans
keep every use of chunk c's forward weights on one rotating position
((tick - c) mod P) and every use of its backward weights on another
((tick + c + 1) mod P), so both flows and the gradient flow move r -> r+1, one hop per
tick (see builder.py for the messages).

- weipipe-naive: per microbatch all forwards (stage 0..P-1), then all backwards
  (P-1..0), one step per tick; rank r starts at tick r. 2GP + P - 1 ticks.
- weipipe-interleave: rank r runs forward (m, s) at tick r + mP + s and backward (m, s)
  at tick r + (m+1)P + P-1-s, so a steady tick pairs F at stage s with B at stage
  P-1-s. GP + 2P - 1 ticks.
- weipipe-zb: the interleave grid with each backward split into BACKWARD_INPUT and
  BACKWARD_WEIGHT, ordered I, F, W inside the tick. The backward weights (needed only
  by I) leave right after I, the forward weights right after F; W, which needs no
  weights, runs while they travel, and its result joins the gradient token before that
  token leaves at the end of the tick. The hop that paces the ring is no longer held
  back by W (nor, for backward weights, by F).
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Kind, Schedule, ScheduleError
from .builder import Compute, build_schedule

SCHEDULES = ("weipipe-naive", "weipipe-interleave", "weipipe-zb")


def _check(P: int, G: int) -> None:
    if P < 2:
        raise ScheduleError(f"WeiPipe needs a ring of at least 2 ranks, got P={P}")
    if G < 1:
        raise ScheduleError(f"WeiPipe needs at least 1 microbatch per rank, got G={G}")


def naive_plan(P: int, G: int):
    plan = defaultdict(list)
    for r in range(P):
        for m in range(G):
            base = r + 2 * P * m
            for s in range(P):
                plan[(r, base + s)].append(Compute(Kind.FORWARD, m, s))
            plan[(r, base + P - 1)].append(Compute(Kind.LOSS, m, P - 1))
            for k in range(P):
                plan[(r, base + P + k)].append(Compute(Kind.BACKWARD, m, P - 1 - k))
    return plan


def _grid(P: int, G: int):
    """(rank, tick) -> (forward (m, s) or None, backward (m, s) or None) for the interleave grid."""
    cells = defaultdict(lambda: [None, None])
    for r in range(P):
        for m in range(G):
            for s in range(P):
                cells[(r, r + m * P + s)][0] = (m, s)
                cells[(r, r + (m + 1) * P + P - 1 - s)][1] = (m, s)
    return cells


def interleave_plan(P: int, G: int):
    plan = {}
    for key, (fwd, bwd) in _grid(P, G).items():
        steps = []
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD, *bwd))
        if fwd is not None:
            steps.append(Compute(Kind.FORWARD, *fwd))
            if fwd[1] == P - 1:
                steps.append(Compute(Kind.LOSS, fwd[0], P - 1))
        plan[key] = steps
    return plan


def zb_plan(P: int, G: int):
    plan = {}
    for key, (fwd, bwd) in _grid(P, G).items():
        steps = []
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD_INPUT, *bwd))
        if fwd is not None:
            steps.append(Compute(Kind.FORWARD, *fwd))
            if fwd[1] == P - 1:
                steps.append(Compute(Kind.LOSS, fwd[0], P - 1))
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD_WEIGHT, *bwd))
        plan[key] = steps
    return plan


_PLANS = {
    "weipipe-naive": naive_plan,
    "weipipe-interleave": interleave_plan,
    "weipipe-zb": zb_plan,
}


def generate(schedule: str, P: int, G: int) -> Schedule:
    """Per-rank action lists of a WeiPipe schedule on a ring of P ranks, G microbatches each."""
    if schedule not in _PLANS:
        raise ScheduleError(f"unknown WeiPipe schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    _check(P, G)
    return build_schedule(schedule, P, G, _PLANS[schedule](P, G))
