"""weipipe-naive: per microbatch all forwards (stage 0..P-1), then all backwards
(P-1..0), one step per tick; rank r starts at tick r. 2GP + P - 1 ticks.

Like every WeiPipe variant this module only says what each ring rank computes at each
tick (see generate.py for the conventions); builder.py derives the messages.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_weipipe.schedules.ir.actions import Kind
from megatron_weipipe.schedules.generate.builder import Compute, Plan


def plan(P: int, G: int) -> Plan:
    out = defaultdict(list)
    for r in range(P):
        for m in range(G):
            base = r + 2 * P * m
            for s in range(P):
                out[(r, base + s)].append(Compute(Kind.FORWARD, m, s))
            out[(r, base + P - 1)].append(Compute(Kind.LOSS, m, P - 1))
            for k in range(P):
                out[(r, base + P + k)].append(Compute(Kind.BACKWARD, m, P - 1 - k))
    return out
