"""Megatron's 1F1B and interleaved 1F1B schedules as per-rank action lists, plus the
tick table shared with WeiPipe schedules.

These lists exist only to draw timelines and count bubbles on the same footing as the
WeiPipe schedules (same Action type, same simulator); training runs megatron-core's
own forward_backward functions. The order of each rank's list follows megatron-core:
min(P - r - 1, N) warm-up forwards then 1F1B then cool-down backwards; interleaved:
(P - r - 1) * 2 + (V - 1) * P warm-up steps over virtual microbatches, model chunk
(k // P) % V for the k-th forward. Ticks are start times with unit costs (F = B = 1),
the classic picture; bubble fractions come from simulate() with F = 1, B = 2 like
every other schedule.
"""

from __future__ import annotations

from typing import Optional

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Action, Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.timing.tick_simulator import simulate


def _fwd(rank: int, mb: int, stage: int, num_stages: int, P: int) -> list[Action]:
    out = []
    if stage > 0:
        out.append(Action(Kind.RECV, rank, 0, mb=mb, chunk=stage, peer=(rank - 1) % P,
                          flow=Flow.ACTIVATIONS, tag=Flow.ACTIVATIONS.tag))
    out.append(Action(Kind.FORWARD, rank, 0, mb=mb, chunk=stage))
    if stage < num_stages - 1:
        out.append(Action(Kind.SEND, rank, 0, mb=mb, chunk=stage, peer=(rank + 1) % P,
                          flow=Flow.ACTIVATIONS, tag=Flow.ACTIVATIONS.tag))
    else:
        out.append(Action(Kind.LOSS, rank, 0, mb=mb, chunk=stage))
    return out


def _bwd(rank: int, mb: int, stage: int, num_stages: int, P: int) -> list[Action]:
    out = []
    if stage < num_stages - 1:
        out.append(Action(Kind.RECV, rank, 0, mb=mb, chunk=stage, peer=(rank + 1) % P,
                          flow=Flow.ACTIVATION_GRADS, tag=Flow.ACTIVATION_GRADS.tag))
    out.append(Action(Kind.BACKWARD, rank, 0, mb=mb, chunk=stage))
    if stage > 0:
        out.append(Action(Kind.SEND, rank, 0, mb=mb, chunk=stage, peer=(rank - 1) % P,
                          flow=Flow.ACTIVATION_GRADS, tag=Flow.ACTIVATION_GRADS.tag))
    return out


def _order(P: int, V: int, N: int, rank: int) -> list[tuple[str, int, int]]:
    """("F"|"B", microbatch, stage) in megatron-core's order for this rank."""
    total = N * V

    def mb_stage(k: int, forward: bool) -> tuple[int, int]:
        v = (k // P) % V
        if not forward:
            v = V - 1 - v
        return (k // (P * V)) * P + k % P, v * P + rank

    if V == 1:
        warmup = min(P - rank - 1, N)
    else:
        warmup = min((P - rank - 1) * 2 + (V - 1) * P, total)
    steps = [("F", *mb_stage(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        steps.append(("F", *mb_stage(warmup + i, True)))
        steps.append(("B", *mb_stage(i, False)))
    for i in range(total - warmup, total):
        steps.append(("B", *mb_stage(i, False)))
    return steps


def megatron_timeline(name: str, P: int, N: int, V: int = 2) -> Schedule:
    """1F1B (V = 1) or interleaved 1F1B (V virtual stages per rank) over N microbatches."""
    found = registry.find(name)
    if found is None or found.timeline is None:
        raise ScheduleError(f"unknown Megatron schedule {name!r}")
    if not found.virtual_stages:
        V = 1
    if P < 1 or N < 1 or V < 1:
        raise ScheduleError(f"{name}: need P, N, V >= 1, got P={P} N={N} V={V}")
    if V > 1 and N % P:
        raise ScheduleError(f"interleaved 1F1B needs the number of microbatches ({N}) to be a multiple of P={P}")
    if V > 1 and P < 2:
        raise ScheduleError("interleaved 1F1B needs at least 2 pipeline ranks")
    S = P * V
    ranks = []
    for r in range(P):
        acts: list[Action] = []
        for kind, mb, stage in _order(P, V, N, r):
            acts.extend(_fwd(r, mb, stage, S, P) if kind == "F" else _bwd(r, mb, stage, S, P))
        ranks.append(acts)
    sched = Schedule(name=name, family="megatron", num_ranks=P, num_chunks=S, microbatches=N,
                     ranks=tuple(tuple(a) for a in ranks), virtual_stages=V)
    return _with_unit_ticks(sched)


def _with_unit_ticks(sched: Schedule) -> Schedule:
    unit = {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.0, Kind.LOSS: 0.0}
    timing = simulate(sched, unit)
    ranks = []
    for timed in timing.per_rank:
        acts = [t.action for t in timed]
        ticks = [int(t.start) if t.action.kind in COMPUTE_KINDS else None for t in timed]
        # a RECV belongs to the tick of the compute after it, a SEND to the one before it
        nxt = None
        for i in range(len(acts) - 1, -1, -1):
            if ticks[i] is not None:
                nxt = ticks[i]
            elif acts[i].kind is Kind.RECV:
                ticks[i] = nxt
        prev = 0
        for i in range(len(acts)):
            if ticks[i] is None:
                ticks[i] = prev
            prev = ticks[i]
        ranks.append(tuple(_retick(a, t) for a, t in zip(acts, ticks)))
    return sched.replace_ranks(ranks)


def _retick(a: Action, tick: int) -> Action:
    return Action(a.kind, a.rank, tick, mb=a.mb, chunk=a.chunk, buffer=a.buffer, grad=a.grad,
                  peer=a.peer, flow=a.flow, tag=a.tag)


def build(name: str, P: int, G: int, *, N: Optional[int] = None, V: int = 2) -> Schedule:
    """Any schedule of registry.plan_names(). Megatron schedules default to N = G * P
    microbatches, the number a WeiPipe ring of P ranks consumes with G per rank."""
    found = registry.find(name)
    if found is not None and found.family == registry.WEIPIPE:
        return generate(name, P, G)
    return megatron_timeline(name, P, N if N is not None else G * P, V)


def tick_table(schedule: Schedule, *, show_loss: bool = False) -> str:
    """Markdown table: one row per tick (0-indexed), one column per rank, '+'-joined
    compute labels (F1.s0 forward of microbatch 1 at stage 0, B backward, I input-grad,
    W weight-grad), '-' for none."""
    T = schedule.num_ticks()
    cells = [[[] for _ in range(schedule.num_ranks)] for _ in range(T)]
    for a in schedule.all_actions():
        if a.kind in COMPUTE_KINDS and (show_loss or a.kind is not Kind.LOSS):
            cells[a.tick][a.rank].append(a.label())
    head = "| tick | " + " | ".join(f"r{r}" for r in range(schedule.num_ranks)) + " |"
    sep = "|---" * (schedule.num_ranks + 1) + "|"
    rows = [head, sep]
    for t in range(T):
        rows.append(f"| {t} | " + " | ".join("+".join(c) or "-" for c in cells[t]) + " |")
    return "\n".join(rows)
