"""megatron-core's point-to-point calls over a 1F1B or interleaved action list.

With `overlap_p2p_comm` off (megatron-core's default and the trainer's), every p2p call
(`recv_forward`, `send_forward_recv_backward`, `send_forward_backward_recv_forward_backward`,
...) posts its operations together and waits for all of them, sends included, before the
rank computes again. The NCCL check (ir/posts.py) and the timed replay
(timing/replay.py) both group a list's SEND/RECV actions into these calls here.

A step is `OneAction(i)`, action i alone, or `P2PCall((i, ...))`, one call.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Union

from megatron_weipipe.schedules.ir.actions import Action, Kind


@dataclass(frozen=True)
class OneAction:
    """Action `index` of the rank's list, on its own."""

    index: int


@dataclass(frozen=True)
class P2PCall:
    """One p2p call: the SEND/RECV actions `ops` posted together and all waited for."""

    ops: tuple[int, ...]


CallStep = Union[OneAction, P2PCall]


def megatron_calls(acts: tuple[Action, ...], interleaved: bool) -> list[CallStep]:
    """The rank's steps. 1F1B: a run of messages splits where a flow repeats
    (recv_forward, then send_forward_recv_backward, ...). Interleaved: one call after
    each warm-up forward, after each steady-state forward+backward pair and after each
    cool-down backward, holding that step's sends and the next step's receives
    (send_forward_recv_forward, send_forward_backward_recv_forward_backward, ...), plus
    the first recv_forward; when every forward is in the warm-up, recv_backward alone."""
    if not interleaved:
        return _one_f_one_b_calls(acts)

    units: list[list[int]] = []  # compute steps; LOSS rides with its forward
    comp = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    kinds = [acts[i].kind for i in comp]
    n_f = kinds.count(Kind.FORWARD)
    first_b = kinds.index(Kind.BACKWARD) if Kind.BACKWARD in kinds else len(kinds)
    warmup = n_f if first_b == n_f else first_b - 1
    k = 0
    while k < len(comp):
        width = 2 if warmup <= k < 2 * n_f - warmup and kinds[k] is Kind.FORWARD else 1
        units.append(comp[k:k + width])
        k += width
    owner = {}
    for u, idx in enumerate(units):
        for i in idx:
            owner[i] = u
    recvs_for: dict[int, list[int]] = defaultdict(list)
    sends_of: dict[int, list[int]] = defaultdict(list)
    extra: dict[int, list[int]] = defaultdict(list)  # LOSS and friends after a compute
    for i, a in enumerate(acts):
        if a.kind is Kind.RECV:
            nxt = next(j for j in range(i + 1, len(acts)) if j in owner)
            recvs_for[owner[nxt]].append(i)
        elif a.kind is Kind.SEND:
            prv = next(j for j in range(i - 1, -1, -1) if j in owner)
            sends_of[owner[prv]].append(i)
        elif i not in owner:
            prv = next(j for j in range(i - 1, -1, -1) if j in owner)
            extra[prv].append(i)
    out: list[CallStep] = []
    if recvs_for[0]:
        out.append(P2PCall(tuple(recvs_for[0])))
    for u, idx in enumerate(units):
        for i in idx:
            out.append(OneAction(i))
            out.extend(OneAction(j) for j in extra[i])
        if warmup == n_f and u == n_f - 1:  # all forwards in warm-up: recv_backward is its own call
            out.extend(P2PCall(tuple(c)) for c in (sends_of[u], recvs_for[u + 1]) if c)
            continue
        call = sends_of[u] + recvs_for[u + 1]
        if call:
            out.append(P2PCall(tuple(call)))
    return out


def _one_f_one_b_calls(acts: tuple[Action, ...]) -> list[CallStep]:
    steps: list[CallStep] = []
    group: list[int] = []
    for i, a in enumerate(acts):
        if a.kind in (Kind.SEND, Kind.RECV):
            if group and acts[group[-1]].flow == a.flow:
                steps.append(P2PCall(tuple(group)))
                group = []
            group.append(i)
            continue
        if group:
            steps.append(P2PCall(tuple(group)))
            group = []
        steps.append(OneAction(i))
    if group:
        steps.append(P2PCall(tuple(group)))
    return steps
