"""Numbers read off a schedule's data, and the closed forms they must equal.

Conventions: a tick count is the number of ticks that hold compute; a rank's idle
ticks are ticks in that range where it computes nothing. The bubble fraction is
measured by simulate.simulate (F = 1, B = 2, I = W = 1, loss 0, transfers hidden):
1 - sum(busy) / (ranks x makespan), the same for every schedule family.
Traffic counts SEND actions: a weight message is one chunk in the compute dtype, a
gradient message one chunk in the gradient dtype (fp32 by default), a placement message
one chunk in the compute dtype.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.timing.tick_simulator import DEFAULT_COSTS, simulate


def idle_ticks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, ticks in [0, num_ticks) in which the rank runs no compute."""
    total = schedule.num_ticks()
    out = []
    for actions in schedule.ranks:
        busy = {a.tick for a in actions if a.kind in COMPUTE_KINDS and a.kind is not Kind.LOSS}
        out.append(total - len(busy))
    return tuple(out)


def bubble_fraction(schedule: Schedule, costs: Mapping[Kind, float] = DEFAULT_COSTS) -> float:
    return simulate(schedule, costs).bubble_fraction


def message_counts(schedule: Schedule) -> tuple[dict[Flow, int], ...]:
    """Per rank, number of messages it sends per flow."""
    out = []
    for actions in schedule.ranks:
        out.append(dict(Counter(a.flow for a in actions if a.kind is Kind.SEND)))
    return tuple(out)


def received_counts(schedule: Schedule) -> tuple[dict[Flow, int], ...]:
    out = []
    for actions in schedule.ranks:
        out.append(dict(Counter(a.flow for a in actions if a.kind is Kind.RECV)))
    return tuple(out)


@dataclass(frozen=True)
class FlowTraffic:
    messages: int
    elements: int
    bytes: int


def traffic(
    schedule: Schedule,
    elements: Mapping[Flow, int],
    element_bytes: Mapping[Flow, int],
    *,
    received: bool = False,
) -> tuple[dict[Flow, FlowTraffic], ...]:
    """Per rank and flow: messages, elements and bytes sent (or received).

    `elements[flow]` is the size of one message of that flow (chunk numel for weight,
    placement and gradient flows; micro_batch*seq*hidden for activation flows) and
    `element_bytes[flow]` its dtype size (e.g. 2 for bf16 weights, 4 for fp32 grads)."""
    counts = received_counts(schedule) if received else message_counts(schedule)
    out = []
    for per_flow in counts:
        row = {}
        for flow, n in per_flow.items():
            e = n * elements[flow]
            row[flow] = FlowTraffic(n, e, e * element_bytes[flow])
        out.append(row)
    return tuple(out)


def weipipe_message_sizes(chunk_numel: int, weight_bytes: int = 2, grad_bytes: int = 4):
    """(elements, element_bytes) mappings for `traffic` on a WeiPipe schedule."""
    elements = {Flow.FWD_WEIGHTS: chunk_numel, Flow.BWD_WEIGHTS: chunk_numel,
                Flow.PLACEMENT: chunk_numel, Flow.GRADS: chunk_numel}
    sizes = {Flow.FWD_WEIGHTS: weight_bytes, Flow.BWD_WEIGHTS: weight_bytes,
             Flow.PLACEMENT: weight_bytes, Flow.GRADS: grad_bytes}
    return elements, sizes


# ---------------------------------------------------------------- closed forms

def expected_ticks(name: str, P: int, G: int) -> int:
    return {"weipipe-naive": 2 * G * P + P - 1}.get(name, G * P + 2 * P - 1)


def expected_messages(name: str, P: int, G: int, rank: int) -> dict[Flow, int]:
    """Messages `rank` sends per flow in one iteration (derived from the token routes,
    see docs/how-it-works/weipipe.md). All three WeiPipe schedules route identically; the naive one
    keeps the flows turning for P(G-1) more ticks."""
    if name not in ("weipipe-naive", "weipipe-interleave", "weipipe-zb"):
        raise ScheduleError(f"no closed form for {name}")
    r, last = rank, rank == P - 1
    fwd = G * P - 1 if last else G * P + max(0, 2 * r + 1 - P)
    bwd = G * P - 1 if last else G * P + r
    grads = G * P + P - 2 - r
    extra = P * (G - 1) if name == "weipipe-naive" else 0
    out = {Flow.FWD_WEIGHTS: fwd + extra, Flow.BWD_WEIGHTS: bwd + extra, Flow.GRADS: grads + extra}
    if 1 <= r and 2 * r < P:  # owner r places its chunk at rank P - r before tick 0's rotation
        out[Flow.PLACEMENT] = 1
    return out


def expected_ring_totals(name: str, P: int, G: int) -> dict[Flow, int]:
    """Messages over the whole ring per flow: per chunk, one hop per tick of its route."""
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    extra = P * P * (G - 1) if name == "weipipe-naive" else 0
    return {
        Flow.FWD_WEIGHTS: P * (G * P - 1) + tri((P + 1) // 2 - 1) + tri(P // 2) + extra,
        Flow.BWD_WEIGHTS: P * (G * P - 1) + tri(P - 1) + extra,
        Flow.GRADS: P * (G * P - 1) + tri(P - 1) + extra,
        Flow.PLACEMENT: (P + 1) // 2 - 1,
    }


def expected_bubble(name: str, P: int, G: int) -> Fraction:
    """Bubble fraction under simulate's default costs (F=1, B=2, I=W=1), exact.

    1f1b / interleaved take N (= G here) as the number of microbatches; see timeline.py."""
    work = 3 * G * P
    extra = {
        "weipipe-naive": (P - 1) * (G + 1),
        "weipipe-interleave": 2 * (P - 1),
        "weipipe-zb": P - 1,
    }[name]
    return Fraction(extra, work + extra)


def expected_makespan(name: str, P: int, G: int, F: float, B: float = 0.0, I: float = 0.0, W: float = 0.0) -> float:
    """Simulated makespan at any compute costs (loss 0, transfers hidden), exact.

    weipipe-interleave: GP(F + B) + (P-1) max(F, B); weipipe-zb: GP(F + I + W) +
    (P-1) max(F, I, W). Every hop between neighbours waits for the compute its token
    follows (F for forward weights, B or I for backward weights, W for the gradient),
    so each of the P-1 offsets between ring ranks is the largest of them; the last rank
    then runs its GP ticks without a gap. With I = W = F this is the lower bound
    (P-1)F + GP(F + I + W): no placement of W can shorten it, and for I or W above F
    no placement of W removes the extra (P-1)(max - F), which comes from sending a
    token only after the compute it follows."""
    if name == "weipipe-interleave":
        return G * P * (F + B) + (P - 1) * max(F, B)
    if name == "weipipe-zb":
        return G * P * (F + I + W) + (P - 1) * max(F, I, W)
    raise ScheduleError(f"no closed form for the makespan of {name}")
