"""Discrete-event replay of per-rank action lists on devices and links.

Two posting rules, one per runtime that executes these lists:

- "async" (WeiPipeRuntime): a SEND is an isend posted where it stands and never waited
  until the end of the rank's list; the irecv of a RECV at tick t is posted when the
  rank starts its first action of tick t - lookahead, and the RECV waits for the data.
- "blocking" (megatron-core's p2p with overlap off): consecutive SEND/RECV actions form
  one call (send_forward_recv_backward and friends; a second action of the same flow
  starts a new call), all posted together and all waited for before the rank goes on.
  This rule fits the 1F1B timeline, whose order is megatron-core's call sequence. The
  interleaved timeline's order is not (megatron-core combines both directions after a
  forward and a backward there), so it is replayed with "async" posting.

A message moves once both its send and its receive are posted (NCCL and gloo both
rendezvous), over the link between the two ranks; messages between the same pair in
the same direction queue behind each other. Compute runs on one stream per rank; on a
CPU host several ranks may share fewer cores than there are ranks (and other jobs), and
then every busy rank on the host progresses at min(1, cores / (busy + background))
(fair processor sharing).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_weipipe.schedules.weipipe.actions import COMPUTE_KINDS, Action, Flow, Kind, Schedule

from .errors import SimulatorError
from .hardware import LinkSpec

EPS = 1e-12


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    flow: Optional[Flow]
    nbytes: int
    link: str
    ready: float  # both sides posted
    start: float  # first byte on the wire (after queueing behind earlier messages)
    end: float  # delivered


@dataclass(frozen=True)
class Trace:
    per_rank: tuple[tuple[TimedAction, ...], ...]
    transfers: tuple[Transfer, ...]
    finish: tuple[float, ...]  # per rank: list done and its sends delivered
    work: tuple[float, ...]  # per rank: compute seconds at full speed (and host CPU of messages)

    @property
    def makespan(self) -> float:
        return max(self.finish) if self.finish else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time in which no compute runs (compute slowed down by sharing a
        host's cores counts as busy)."""
        total = self.makespan * len(self.per_rank)
        busy = sum(t.end - t.start for timed in self.per_rank for t in timed if t.action.kind in COMPUTE_KINDS)
        return 0.0 if total <= 0 else 1.0 - busy / total

    def times_of(self, kind: Kind) -> dict[int, list[float]]:
        out: dict[int, list[float]] = defaultdict(list)
        for rank, timed in enumerate(self.per_rank):
            for t in timed:
                if t.action.kind is kind:
                    out[rank].append(t.start)
        return out

    def bytes_sent(self) -> list[dict[str, int]]:
        """Per rank: bytes sent per link name."""
        out = [defaultdict(int) for _ in self.per_rank]
        for t in self.transfers:
            out[t.src][t.link] += t.nbytes
        return [dict(d) for d in out]


@dataclass
class EventModel:
    """What the replay needs besides the lists."""

    duration: Callable[[Action], float]  # compute seconds of an action at full speed
    message_bytes: Callable[[Action], int]  # bytes of a SEND
    link: Callable[[int, int], LinkSpec]  # (sender rank, receiver rank) -> link
    semantics: str = "async"  # "async" (WeiPipe runtime, interleaved timeline) or "blocking" (1F1B)
    lookahead: int = 1
    host_of: Optional[Callable[[int], int]] = None  # rank -> host, for processor sharing
    cores_per_host: Optional[float] = None
    background: float = 0.0  # other CPU-bound tasks on every host
    start_times: Optional[tuple[float, ...]] = None  # per rank, default 0

    def __post_init__(self):
        if self.semantics not in ("async", "blocking"):
            raise SimulatorError(f"unknown posting rule {self.semantics!r}")
        if self.lookahead < 0:
            raise SimulatorError("lookahead must be >= 0 ticks")


@dataclass
class _Msg:
    src: int
    j: int  # index of the SEND in the sender's list
    dst: int = -1
    i: int = -1  # index of the RECV in the receiver's list
    send_post: Optional[float] = None
    recv_post: Optional[float] = None
    end: Optional[float] = None
    done: bool = False


@dataclass
class _Rank:
    steps: list  # ("one", i) or ("group", [i, ...])
    pc: int = 0
    mode: str = "ready"  # ready | compute | wait | done
    remaining: float = 0.0
    started: float = 0.0
    waiting: set = field(default_factory=set)
    wait_from: float = 0.0
    wait_actions: list = field(default_factory=list)
    timed: list = field(default_factory=list)
    post_at: dict = field(default_factory=dict)  # action index -> RECV indices whose irecv is posted there
    drained: bool = False
    tail: float = 0.0  # host CPU the finished wait's messages still cost (gloo copies), run after it
    in_tail: bool = False


def _match(schedule: Schedule) -> tuple[dict, dict]:
    """(rank, recv index) -> message key and (rank, send index) -> message key, pairing per
    (source, destination, tag) in issue order as gloo and NCCL do."""
    sends: dict[tuple[int, int, int], deque] = defaultdict(deque)
    for r, acts in enumerate(schedule.ranks):
        for j, a in enumerate(acts):
            if a.kind is Kind.SEND:
                sends[(r, a.peer, a.tag)].append(j)
    recv_key, send_key = {}, {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if a.kind is Kind.RECV:
                q = sends.get((a.peer, r, a.tag))
                if not q:
                    raise SimulatorError(f"{a}: no matching send")
                j = q.popleft()
                recv_key[(r, i)] = (a.peer, j)
                send_key[(a.peer, j)] = (a.peer, j)
    left = [k for k, q in sends.items() if q]
    if left:
        raise SimulatorError(f"sends never received on (src, dst, tag) {left[0]}")
    return recv_key, send_key


def _steps(acts: tuple[Action, ...], semantics: str) -> list:
    if semantics == "async":
        return [("one", i) for i in range(len(acts))]
    steps, group = [], []
    for i, a in enumerate(acts):
        if a.kind in (Kind.SEND, Kind.RECV):
            if group and acts[group[-1]].flow == a.flow:
                steps.append(("group", group))
                group = []
            group.append(i)
            continue
        if group:
            steps.append(("group", group))
            group = []
        steps.append(("one", i))
    if group:
        steps.append(("group", group))
    return steps


def replay(schedule: Schedule, model: EventModel) -> Trace:
    P = schedule.num_ranks
    lists = schedule.ranks
    recv_key, send_key = _match(schedule)
    msgs: dict[tuple[int, int], _Msg] = {}
    for (r, i), key in recv_key.items():
        m = msgs.setdefault(key, _Msg(src=key[0], j=key[1]))
        m.dst, m.i = r, i
    channel_free: dict[tuple[int, int], float] = defaultdict(float)
    heap: list = []
    transfers: list[Transfer] = []
    ranks = [_Rank(steps=_steps(lists[r], model.semantics)) for r in range(P)]
    work = [0.0] * P
    finish = [0.0] * P
    clock0 = model.start_times or (0.0,) * P

    if model.semantics == "async":
        for r in range(P):
            acts = lists[r]
            first_of_tick: list[tuple[int, int]] = []  # (tick, first index)
            for i, a in enumerate(acts):
                if not first_of_tick or a.tick != first_of_tick[-1][0]:
                    first_of_tick.append((a.tick, i))
            for i, a in enumerate(acts):
                if a.kind is not Kind.RECV:
                    continue
                at = i
                for tick, j in first_of_tick:
                    if tick + model.lookahead >= a.tick:
                        at = min(j, i)
                        break
                ranks[r].post_at.setdefault(at, []).append(i)

    def try_start(m: _Msg) -> None:
        if m.send_post is None or m.recv_post is None or m.end is not None:
            return
        a = lists[m.src][m.j]
        nbytes = int(model.message_bytes(a))
        link = model.link(m.src, m.dst)
        ready = max(m.send_post, m.recv_post)
        start = max(ready, channel_free[(m.src, m.dst)])
        wire = nbytes / (link.bandwidth_gbs * 1e9)
        channel_free[(m.src, m.dst)] = start + wire
        m.end = start + wire + link.latency_us * 1e-6
        transfers.append(Transfer(m.src, m.dst, a.flow, nbytes, link.name, ready, start, m.end))
        heapq.heappush(heap, (m.end, m.src, m.j))

    def post_send(r: int, j: int, now: float) -> tuple[int, int]:
        key = send_key.get((r, j), (r, j))
        m = msgs.get(key)
        if m is None:
            raise SimulatorError(f"{lists[r][j]}: never received")
        m.send_post = now
        try_start(m)
        return key

    def post_recv(r: int, i: int, now: float) -> tuple[int, int]:
        key = recv_key[(r, i)]
        m = msgs[key]
        if m.recv_post is None:
            m.recv_post = now
            try_start(m)
        return key

    def comm_cpu(r: int, i: int) -> float:
        """This side's half of the host CPU a message costs (0 unless the link says so)."""
        a = lists[r][i]
        src, dst = (r, a.peer) if a.kind is Kind.SEND else (a.peer, r)
        cpb = model.link(src, dst).cpu_s_per_byte
        if not cpb:
            return 0.0
        m = lists[src][send_key.get((r, i), (r, i))[1]] if a.kind is Kind.SEND else lists[src][recv_key[(r, i)][1]]
        return 0.5 * cpb * model.message_bytes(m)

    def start_compute(st: _Rank, r: int, seconds: float, now: float, tail: bool) -> None:
        st.mode, st.remaining, st.started, st.in_tail = "compute", seconds, now, tail
        work[r] += seconds

    def rate(r: int, computing: list[int]) -> float:
        if model.cores_per_host is None or model.host_of is None:
            return 1.0
        host = model.host_of(r)
        busy = sum(1 for q in computing if model.host_of(q) == host)
        return min(1.0, model.cores_per_host / (max(busy, 1) + model.background))

    def advance(r: int, now: float) -> None:
        st = ranks[r]
        acts = lists[r]
        while st.mode == "ready":
            if st.pc >= len(st.steps):
                own = [k for k, m in msgs.items() if k[0] == r and not m.done]
                if own and not st.drained:
                    st.mode, st.waiting, st.wait_from, st.wait_actions = "wait", set(own), now, []
                    st.drained = True
                    return
                st.mode = "done"
                finish[r] = now
                return
            kind, payload = st.steps[st.pc]
            if kind == "group":
                keys = set()
                for i in payload:
                    a = acts[i]
                    keys.add(post_send(r, i, now) if a.kind is Kind.SEND else post_recv(r, i, now))
                st.mode, st.waiting, st.wait_from, st.wait_actions = "wait", keys, now, list(payload)
                st.tail = sum(comm_cpu(r, i) for i in payload)
                st.pc += 1
                return
            i = payload
            for k in st.post_at.get(i, ()):
                post_recv(r, k, now)
            a = acts[i]
            if a.kind is Kind.SEND:
                post_send(r, i, now)
                cw = comm_cpu(r, i)
                if cw > 0:
                    start_compute(st, r, cw, now, tail=False)
                    return
                st.timed.append(TimedAction(a, now, now))
                st.pc += 1
            elif a.kind is Kind.RECV:
                key = post_recv(r, i, now)
                st.mode, st.waiting, st.wait_from, st.wait_actions = "wait", {key}, now, [i]
                st.tail = comm_cpu(r, i)
                st.pc += 1
                return
            elif a.kind in COMPUTE_KINDS and model.duration(a) > 0:
                start_compute(st, r, model.duration(a), now, tail=False)
                return
            else:
                st.timed.append(TimedAction(a, now, now))
                st.pc += 1

    def release_waits(now: float) -> None:
        for r, st in enumerate(ranks):
            if st.mode == "wait" and all(msgs[k].done for k in st.waiting):
                for i in st.wait_actions:
                    st.timed.append(TimedAction(lists[r][i], st.wait_from, now))
                st.mode, st.waiting, st.wait_actions = "ready", set(), []
                if st.tail > 0:
                    start_compute(st, r, st.tail, now, tail=True)
                    st.tail = 0.0

    now = 0.0
    started = [False] * P
    while True:
        for r in range(P):
            if not started[r] and clock0[r] <= now + EPS:
                started[r] = True
        changed = True
        while changed:
            changed = False
            release_waits(now)
            for r in range(P):
                if started[r] and ranks[r].mode == "ready":
                    advance(r, now)
                    changed = True
        if all(st.mode == "done" for st in ranks):
            break
        computing = [r for r in range(P) if ranks[r].mode == "compute"]
        rates = {r: rate(r, computing) for r in computing}
        candidates = [now + ranks[r].remaining / rates[r] for r in computing]
        if heap:
            candidates.append(heap[0][0])
        candidates += [clock0[r] for r in range(P) if not started[r]]
        if not candidates:
            blocked = [f"rank {r} waits at step {ranks[r].pc}" for r in range(P) if ranks[r].mode == "wait"]
            raise SimulatorError("deadlock in replay: " + "; ".join(blocked))
        t = max(min(candidates), now)
        for r in computing:
            ranks[r].remaining -= (t - now) * rates[r]
        now = t
        while heap and heap[0][0] <= now + EPS:
            _, src, j = heapq.heappop(heap)
            msgs[(src, j)].done = True
        for r in computing:
            st = ranks[r]
            if st.remaining <= EPS * max(1.0, now):
                st.mode, st.remaining = "ready", 0.0
                if st.in_tail:  # the CPU side of messages already received: no action of its own
                    st.in_tail = False
                    continue
                a = lists[r][st.steps[st.pc][1]]
                st.timed.append(TimedAction(a, st.started, now))
                st.pc += 1
    return Trace(
        per_rank=tuple(tuple(st.timed) for st in ranks),
        transfers=tuple(sorted(transfers, key=lambda t: (t.start, t.src))),
        finish=tuple(finish),
        work=tuple(work),
    )
