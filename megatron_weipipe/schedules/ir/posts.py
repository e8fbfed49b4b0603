"""How a rank posts its messages: the one description the WeiPipe runtime executes and
the NCCL check (nccl.py) proves deadlock-free.

A rank's program is a list of steps: an `int` i runs action i of its list (a SEND hands
its buffer over to be posted, a RECV waits for its message, anything else computes),
a `Post` posts point-to-point operations, and a `Wait` blocks until operations are
done. Posting orders for WeiPipe lists:

- "parity" (default, what the runtime posts): single operations; odd ring ranks post
  like recv-first, even ring ranks post a tick's lookahead irecvs after that tick's sends
  (megatron-core's rank-parity idea), so at a ring of 2, where both directions share one
  pair communicator, each rank's next operation meets the peer's. Sends still leave right
  after their last use and odd ranks keep receiving one tick ahead. Needs lookahead 1:
  with more, one rank's stream holds two receives where the peer's holds one send.
- "grouped": every message belongs to the round of the tick it is received
  in; a rank posts all its operations of round k as one `batch_isend_irecv` after its
  last SEND of that round and before its first RECV of it. Every rank posts rounds in
  the same order on one communicator, so round k's batches all complete together:
  deadlock-free under NCCL by construction (and checked). A send then leaves at the end
  of its tick rather than right after its last use.
- "recv-first": each tick starts by posting the irecvs of the next `lookahead` ticks,
  then isends are posted where they stand, all as single operations. gloo runs it; under
  NCCL at a ring of 2 both ranks block in a receive (the NCCL check shows it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Union

from megatron_weipipe.schedules.ir.actions import Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.check.calls import OneAction, megatron_calls

ORDERS = ("grouped", "recv-first", "parity")
DEFAULT_ORDER = "parity"
MEGATRON_ORDERS = ("batched", "parity")


@dataclass(frozen=True)
class Post:
    """Operations (action indices of SEND/RECV) posted at this point, in this order.
    `batched`: one batch_isend_irecv on `group` (NCCL: the group's own communicator, the
    batch completes as a whole); otherwise one isend/irecv each (NCCL: the communicator of
    the pair of ranks within `group`)."""

    ops: tuple[int, ...]
    batched: bool
    group: str = "ring"


@dataclass(frozen=True)
class Wait:
    ops: tuple[int, ...]


Step = Union[int, Post, Wait]


def pair_messages(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(src rank, SEND index) -> (dst rank, RECV index): the intended pairing, per
    (source, destination, tag) in list order."""
    recvs: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if a.kind is Kind.RECV:
                recvs[(a.peer, r, a.tag)].append(i)
    taken: dict[tuple[int, int, int], int] = defaultdict(int)
    out = {}
    for r, acts in enumerate(schedule.ranks):
        for j, a in enumerate(acts):
            if a.kind is Kind.SEND:
                key = (r, a.peer, a.tag)
                n = taken[key]
                if n >= len(recvs[key]):
                    raise ScheduleError(f"{a}: rank {a.peer} never receives it")
                out[(r, j)] = (a.peer, recvs[key][n])
                taken[key] += 1
    for key, idx in recvs.items():
        if taken[key] < len(idx):
            raise ScheduleError(f"{schedule.ranks[key[1]][idx[taken[key]]]}: no matching send")
    return out


def rank_posts(schedule: Schedule, rank: int, *, order: str = DEFAULT_ORDER, lookahead: int = 1,
               pairs: Optional[dict] = None) -> list[Step]:
    """The steps rank `rank` executes for a WeiPipe list under `order`."""
    if order not in ORDERS:
        raise ScheduleError(f"unknown posting order {order!r}; choose one of {', '.join(ORDERS)}")
    if lookahead < 0:
        raise ScheduleError(f"lookahead must be >= 0 ticks, got {lookahead}")
    if order == "parity" and lookahead != 1:
        raise ScheduleError(
            f"parity posting needs lookahead 1, got {lookahead}: on a pair communicator the two ranks' "
            "operations must alternate send/receive; use order grouped (or recv-first on gloo)")
    pairs = pair_messages(schedule) if pairs is None else pairs
    acts = schedule.ranks[rank]
    if order == "grouped":
        return _grouped(schedule, rank, pairs)
    sender_index = {dst: src for src, dst in pairs.items()}
    recvs = sorted((i for i, a in enumerate(acts) if a.kind is Kind.RECV),
                   key=lambda i: (acts[i].tick, sender_index[(rank, i)][1]))  # per peer in its send order
    late = order == "parity" and rank % 2 == 0
    steps: list[Step] = []
    cursor = 0

    def post_upto(tick: int) -> None:
        nonlocal cursor
        while cursor < len(recvs) and acts[recvs[cursor]].tick <= tick:
            steps.append(Post((recvs[cursor],), batched=False))
            cursor += 1

    for i, a in enumerate(acts):
        if i == 0 or a.tick != acts[i - 1].tick:
            post_upto(a.tick if late else a.tick + lookahead)
        if a.kind is Kind.RECV:
            post_upto(a.tick)  # never wait for an unposted receive
        steps.append(i)
        if a.kind is Kind.SEND:
            steps.append(Post((i,), batched=False))
        if late and (i + 1 == len(acts) or acts[i + 1].tick != a.tick):
            post_upto(a.tick + lookahead)
    return steps


def _grouped(schedule: Schedule, rank: int, pairs: dict) -> list[Step]:
    acts = schedule.ranks[rank]
    rounds: dict[int, list[int]] = defaultdict(list)  # receive tick -> action indices
    for i, a in enumerate(acts):
        if a.kind is Kind.RECV:
            rounds[a.tick].append(i)
        elif a.kind is Kind.SEND:
            dst, k = pairs[(rank, i)]
            rounds[schedule.ranks[dst][k].tick].append(i)
    at: dict[int, list[int]] = defaultdict(list)  # post before action index -> rounds
    floor = 0
    for k in sorted(rounds):
        ops = rounds[k]
        after = max((i + 1 for i in ops if acts[i].kind is Kind.SEND), default=0)
        before = min((i for i in ops if acts[i].kind is Kind.RECV), default=len(acts))
        point = max(after, floor)
        if point > before:
            raise ScheduleError(
                f"rank {rank}: round {k} cannot be one batch: {acts[before]} must wait before "
                f"{acts[after - 1]} can be posted")
        at[point].append(k)
        floor = point
    sender_index = {dst: src for src, dst in pairs.items()}

    def in_batch(i: int) -> tuple:  # receives per peer in the order that peer sends them
        return (0, i) if acts[i].kind is Kind.SEND else (1, sender_index[(rank, i)][1])

    steps: list[Step] = []
    for i in range(len(acts) + 1):
        for k in at.get(i, ()):
            steps.append(Post(tuple(sorted(rounds[k], key=in_batch)), batched=True))
        if i < len(acts):
            steps.append(i)
    return steps


def megatron_posts(schedule: Schedule, rank: int, *, order: str = "batched") -> list[Step]:
    """megatron-core's p2p for a 1F1B / interleaved list (overlap off: every call waits
    for all its requests). Consecutive SEND/RECV actions are one call
    (send_forward_recv_backward and friends). "batched" (batch_p2p_comm): one
    batch_isend_irecv in the order send_prev, recv_prev, send_next, recv_next. "parity"
    (_p2p_ops): single operations, even pipeline ranks send_next, recv_prev, send_prev,
    recv_next, odd ones recv_prev, send_next, recv_next, send_prev; on a pipeline of two,
    one pair of each uses the world group."""
    if order not in MEGATRON_ORDERS:
        raise ScheduleError(f"unknown megatron-core p2p order {order!r}")
    acts = schedule.ranks[rank]
    steps: list[Step] = []
    for call in megatron_calls(acts, schedule.virtual_stages > 1):
        if isinstance(call, OneAction):
            steps.append(call.index)
            continue
        payload = call.ops
        role = {}
        for i in payload:
            a = acts[i]
            forward = a.flow is Flow.ACTIVATIONS
            send = a.kind is Kind.SEND
            role[i] = ("send_next" if forward else "send_prev") if send else ("recv_prev" if forward else "recv_next")
        sends = [i for i in payload if acts[i].kind is Kind.SEND]
        steps.extend(sends)  # the tensors exist before the call
        if order == "batched":
            seq = ("send_prev", "recv_prev", "send_next", "recv_next")
            ops = tuple(sorted(payload, key=lambda i: seq.index(role[i])))
            steps.append(Post(ops, batched=True, group="pp"))
        else:
            even = rank % 2 == 0
            seq = (("send_next", "recv_prev", "send_prev", "recv_next") if even
                   else ("recv_prev", "send_next", "recv_next", "send_prev"))
            ops = tuple(sorted(payload, key=lambda i: seq.index(role[i])))
            for i in ops:
                # even_send_odd_recv_group is the pp group; the other pair the world group at P = 2
                on_pp = (role[i].startswith("send") == even)
                group = "pp" if on_pp or schedule.num_ranks != 2 else "world"
                steps.append(Post((i,), batched=False, group=group))
        steps.append(Wait(tuple(payload)))
        steps.extend(i for i in payload if acts[i].kind is Kind.RECV)
    return steps


def programs(schedule: Schedule, order: Optional[str] = None, lookahead: int = 1) -> list[list[Step]]:
    """Every rank's steps: WeiPipe lists as the runtime posts them (default "grouped"),
    Megatron lists as megatron-core posts them (default "batched")."""
    if schedule.family == "weipipe":
        pairs = pair_messages(schedule)
        return [rank_posts(schedule, r, order=order or DEFAULT_ORDER, lookahead=lookahead, pairs=pairs)
                for r in range(schedule.num_ranks)]
    return [megatron_posts(schedule, r, order=order or "batched") for r in range(schedule.num_ranks)]
