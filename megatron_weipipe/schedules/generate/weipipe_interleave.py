"""weipipe-interleave: rank r runs forward (m, s) at tick r + mP + s and backward (m, s)
at tick r + (m+1)P + P-1-s, so a steady tick pairs F at stage s with B at stage P-1-s.
GP + 2P - 1 ticks.

Like every WeiPipe variant this module only says what each ring rank computes at each
tick (see generate.py for the conventions); builder.py derives the messages.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_weipipe.schedules.ir.actions import Kind
from megatron_weipipe.schedules.generate.builder import Compute, Plan


def grid(P: int, G: int):
    """(rank, tick) -> (forward (m, s) or None, backward (m, s) or None) for the interleave grid."""
    cells = defaultdict(lambda: [None, None])
    for r in range(P):
        for m in range(G):
            for s in range(P):
                cells[(r, r + m * P + s)][0] = (m, s)
                cells[(r, r + (m + 1) * P + P - 1 - s)][1] = (m, s)
    return cells


def plan(P: int, G: int) -> Plan:
    out = {}
    for key, (fwd, bwd) in grid(P, G).items():
        steps = []
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD, *bwd))
        if fwd is not None:
            steps.append(Compute(Kind.FORWARD, *fwd))
            if fwd[1] == P - 1:
                steps.append(Compute(Kind.LOSS, fwd[0], P - 1))
        out[key] = steps
    return out
