"""weipipe-zb: the interleave grid with each backward split into BACKWARD_INPUT and
BACKWARD_WEIGHT, ordered I, F, W inside the tick.

The backward weights (needed only by I) leave right after I, the forward weights right
after F; W, which needs no weights, runs while they travel, and its result joins the
gradient token before that token leaves at the end of the tick. The hop that paces the
ring is no longer held back by W (nor, for backward weights, by F).
"""

from __future__ import annotations

from megatron_weipipe.schedules.ir.actions import Kind
from megatron_weipipe.schedules.generate.builder import Compute, Plan
from megatron_weipipe.schedules.generate.weipipe_interleave import grid


def plan(P: int, G: int) -> Plan:
    out = {}
    for key, (fwd, bwd) in grid(P, G).items():
        steps = []
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD_INPUT, *bwd))
        if fwd is not None:
            steps.append(Compute(Kind.FORWARD, *fwd))
            if fwd[1] == P - 1:
                steps.append(Compute(Kind.LOSS, fwd[0], P - 1))
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD_WEIGHT, *bwd))
        out[key] = steps
    return out
