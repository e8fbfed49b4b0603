"""Turn a compute plan into complete per-rank action lists.

A WeiPipe generator only decides *what* each rank computes at each tick. This module
derives *how the data gets there*: every chunk's forward weights, backward weights and
gradient are one token each, rotating r -> r+1 one hop per tick; the token starts at
its owner (or is placed from the owner by one direct message when the ring rotation
would need it before tick 0), and ends with a DROP after its last use (weights) or an
ACCUMULATE_GRAD at its owner (gradients). Messages are emitted where a runtime posts
them: a RECV right before the first action that needs the buffer, a SEND right after
the last action of the tick that touches it (sends are asynchronous), so the next hop
overlaps whatever compute follows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megatron_weipipe.schedules.ir.actions import Action, Buffer, Flow, Kind, Schedule, ScheduleError

# Which token a compute kind reads (weights) and which gradient token it adds to.
_READS = {
    Kind.FORWARD: Flow.FWD_WEIGHTS,
    Kind.BACKWARD: Flow.BWD_WEIGHTS,
    Kind.BACKWARD_INPUT: Flow.BWD_WEIGHTS,
}
_ADDS_GRAD = frozenset({Kind.BACKWARD, Kind.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Compute:
    """One planned compute step (order inside a tick is the order in the plan)."""

    kind: Kind
    mb: int
    chunk: int


@dataclass
class _Token:
    flow: Flow
    chunk: int
    start: int  # first tick it is resident somewhere
    stops: list = field(default_factory=list)  # (rank, tick) for tick = start, start+1, ...
    placed_from: int = -1  # owner rank when the token starts with a placement message

    @property
    def origin(self) -> Kind:
        if self.flow is Flow.GRADS:
            return Kind.GRAD_INIT
        return Kind.RECV if self.placed_from >= 0 else Kind.LOAD


Plan = Mapping[tuple[int, int], Sequence[Compute]]


def _rotating_token(flow: Flow, chunk: int, uses: list[tuple[int, int]], P: int, owner: int) -> _Token:
    """A token that rotates one hop per tick and visits every (rank, tick) in `uses`."""
    uses = sorted(uses, key=lambda rt: rt[1])
    r0, t0 = uses[0]
    offset = (r0 - t0) % P  # resident at rank (tick + offset) mod P
    for r, t in uses:
        if (t + offset) % P != r:
            raise ScheduleError(
                f"plan error: {flow.value} of chunk {chunk} is used at rank {r0} tick {t0} and at "
                f"rank {r} tick {t}, which one token moving r -> r+1 per tick cannot both reach"
            )
    last = uses[-1][1]
    if flow is Flow.GRADS:
        start = t0
        last_rank = (last + offset) % P
        last += (owner - last_rank) % P  # ride on to the owner
        token = _Token(flow, chunk, start)
    else:
        # latest tick <= first use at which the owner holds the rotating position
        back = (t0 + offset - owner) % P
        start = t0 - back
        token = _Token(flow, chunk, start)
        if start < 0:  # rotation would need it before tick 0: place it by one direct message
            token.start = 0
            token.placed_from = owner
    token.stops = [((t + offset) % P, t) for t in range(token.start, last + 1)]
    return token


def build_schedule(name: str, P: int, G: int, plan: Plan) -> Schedule:
    """Derive tokens from `plan` and emit every rank's ordered action list."""
    if P < 2:
        raise ScheduleError(f"{name}: a weight ring needs at least 2 ranks, got P={P}")
    uses: dict[tuple[Flow, int], list[tuple[int, int]]] = defaultdict(list)
    for (rank, tick), steps in plan.items():
        for step in steps:
            if step.kind in _READS:
                uses[(_READS[step.kind], step.chunk)].append((rank, tick))
            if step.kind in _ADDS_GRAD:
                uses[(Flow.GRADS, step.chunk)].append((rank, tick))
    tokens = {key: _rotating_token(key[0], key[1], u, P, owner=key[1]) for key, u in uses.items()}

    resident: dict[tuple[int, int], list[tuple[_Token, int]]] = defaultdict(list)
    for token in tokens.values():
        for i, stop in enumerate(token.stops):
            resident[stop].append((token, i))
    for (rank, tick), here in resident.items():
        flows = [tok.flow for tok, _ in here]
        if len(flows) != len(set(flows)):
            raise ScheduleError(f"plan error: two {flows} tokens of one flow on rank {rank} at tick {tick}")

    placements: dict[tuple[int, int], list[_Token]] = defaultdict(list)
    for token in tokens.values():
        if token.placed_from >= 0:
            placements[(token.placed_from, token.start)].append(token)

    last_tick = max(t for token in tokens.values() for _, t in token.stops)
    ranks = []
    for rank in range(P):
        out: list[Action] = []
        for tick in range(last_tick + 1):
            out.extend(_emit_tick(rank, tick, P, plan.get((rank, tick), ()), resident[(rank, tick)],
                                  tokens, placements.get((rank, tick), ())))
        ranks.append(tuple(out))
    slots = [(Flow.FWD_WEIGHTS, 2), (Flow.BWD_WEIGHTS, 2), (Flow.GRADS, 2)]
    if placements:
        slots.append((Flow.PLACEMENT, 1))
    return Schedule(name=name, family="weipipe", num_ranks=P, num_chunks=P, microbatches=G,
                    ranks=tuple(ranks), slots=tuple(slots))


def _buf(token: _Token, tick: int) -> Buffer:
    return Buffer(token.flow, tick % 2)


def _emit_tick(rank, tick, P, steps, here, tokens, placing) -> list[Action]:
    out: list[Action] = []
    nxt, prv = (rank + 1) % P, (rank - 1) % P
    stage = Buffer(Flow.PLACEMENT, 0)
    for token in placing:  # owner stages and sends its chunk to the token's first holder
        target = token.stops[0][0]
        out.append(Action(Kind.LOAD, rank, tick, chunk=token.chunk, buffer=stage))
        out.append(Action(Kind.SEND, rank, tick, chunk=token.chunk, buffer=stage, peer=target,
                          flow=Flow.PLACEMENT, tag=Flow.PLACEMENT.tag))

    def arrive(token: _Token, i: int) -> list[Action]:
        buf = _buf(token, tick)
        if i > 0:
            return [Action(Kind.RECV, rank, tick, chunk=token.chunk, buffer=buf, peer=prv,
                           flow=token.flow, tag=token.flow.tag)]
        if token.origin is Kind.RECV:
            return [Action(Kind.RECV, rank, tick, chunk=token.chunk, buffer=buf, peer=token.placed_from,
                           flow=Flow.PLACEMENT, tag=Flow.PLACEMENT.tag)]
        return [Action(token.origin, rank, tick, chunk=token.chunk, buffer=buf)]

    def leave(token: _Token, i: int) -> list[Action]:
        buf = _buf(token, tick)
        if i + 1 < len(token.stops):
            return [Action(Kind.SEND, rank, tick, chunk=token.chunk, buffer=buf, peer=nxt,
                           flow=token.flow, tag=token.flow.tag)]
        if token.flow is Flow.GRADS:
            return [Action(Kind.ACCUMULATE_GRAD, rank, tick, chunk=token.chunk, buffer=buf),
                    Action(Kind.OPTIMIZER_STEP, rank, tick, chunk=token.chunk)]
        return [Action(Kind.DROP, rank, tick, chunk=token.chunk, buffer=buf)]

    def needs(step: Compute) -> list[tuple[_Token, int]]:
        got = []
        for flow in (_READS.get(step.kind), Flow.GRADS if step.kind in _ADDS_GRAD else None):
            if flow is None:
                continue
            for token, i in here:
                if token.flow is flow and token.chunk == step.chunk:
                    got.append((token, i))
                    break
            else:
                raise ScheduleError(f"plan error: rank {rank} tick {tick} {step} has no {flow.value} token")
        return got

    last_use: dict[int, int] = {}
    for j, step in enumerate(steps):
        for token, _ in needs(step):
            last_use[id(token)] = j
    for token, i in sorted(here, key=lambda ti: ti[0].flow.value):  # untouched tokens pass straight on
        if id(token) not in last_use:
            out.extend(arrive(token, i))
            out.extend(leave(token, i))
    arrived: set[int] = set()
    for j, step in enumerate(steps):
        used = needs(step)
        for token, i in used:
            if id(token) not in arrived:
                arrived.add(id(token))
                out.extend(arrive(token, i))
        weights = next((_buf(t, tick) for t, _ in used if t.flow is not Flow.GRADS), None)
        grad = next((_buf(t, tick) for t, _ in used if t.flow is Flow.GRADS), None)
        out.append(Action(step.kind, rank, tick, mb=step.mb, chunk=step.chunk, buffer=weights, grad=grad))
        for token, i in used:
            if last_use[id(token)] == j:
                out.extend(leave(token, i))
    return out
