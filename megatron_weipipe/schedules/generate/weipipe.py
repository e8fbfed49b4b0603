"""WeiPipe compute plans -> per-rank action lists, for every WeiPipe variant of the registry.

A variant is a module with ``plan(P, G)``: what each ring rank computes at each tick,
as {(rank, tick): [Compute(kind, mb, chunk), ...]} in execution order inside the tick.
Ticks are 0-indexed. Rank r runs its own G microbatches through all P chunks; a plan
must keep every use of chunk c's forward weights on one rotating position (e.g.
(tick - c) mod P) and every use of its backward weights on another (e.g.
(tick + c + 1) mod P), so both flows and the gradient flow move r -> r+1, one hop per
tick. builder.py derives the messages; validate.py checks the result.

Variants: weipipe_naive.py, weipipe_interleave.py, weipipe_zb.py (registry.py names them).
"""

from __future__ import annotations

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Schedule, ScheduleError
from megatron_weipipe.schedules.generate.builder import build_schedule


def _check(P: int, G: int) -> None:
    if P < 2:
        raise ScheduleError(f"WeiPipe needs a ring of at least 2 ranks, got P={P}")
    if G < 1:
        raise ScheduleError(f"WeiPipe needs at least 1 microbatch per rank, got G={G}")


def generate(schedule: str, P: int, G: int) -> Schedule:
    """Per-rank action lists of a WeiPipe schedule on a ring of P ranks, G microbatches each."""
    found = registry.find(schedule)
    if found is None or found.family != registry.WEIPIPE:
        raise ScheduleError(
            f"unknown WeiPipe schedule {schedule!r}; choose one of {', '.join(registry.weipipe_names())}"
        )
    _check(P, G)
    return build_schedule(schedule, P, G, registry.load(found.compute_plan)(P, G))
