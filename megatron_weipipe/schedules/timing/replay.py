"""The one event core: replay per-rank action lists in time.

Both the tick simulator (simulate.py: unit costs, free or per-message communication)
and the cluster projection (simulator/cluster_replay.py: devices, links, hosts with shared
cores) run the lists through `replay` below; they differ only in the `ReplayModel`
they pass. This module defines the timed types they share (`TimedAction`, `Transfer`,
`Trace`).

Two posting rules, one per runtime that executes these lists:

- "async" (WeiPipeRuntime): a SEND is an isend posted where it stands and never waited
  until the end of the rank's list; the irecv of a RECV at tick t is posted when the
  rank starts its first action of tick t - lookahead (lookahead None: every irecv is
  posted when the rank starts), and the RECV waits for the data.
- "blocking" (megatron-core's p2p with overlap off): the SEND/RECV actions form
  megatron-core's calls (calls.py: send_forward_recv_backward and friends for 1F1B,
  one call per warm-up, steady or cool-down step for interleaved), each posted together
  and waited for, sends included, before the rank goes on.

A message moves once both its send and its receive are posted (NCCL and gloo both
rendezvous); messages between the same pair in the same direction queue behind each
other for their wire time, then take their latency. A link shaped by a token bucket
(tc tbf: `Wire.burst`) lets the bytes its bucket saved while idle pass at once
(`TokenBucket`). Compute runs on one stream per
rank at the speed `ReplayModel.rate` gives it (1 by default; the cluster model slows
ranks that share a host's cores). A message may also cost host CPU at both ends
(`host_cpu`), charged as compute of the rank that posts it.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Action, Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.check.calls import megatron_calls

EPS = 1e-12
POSTING_RULES = ("async", "blocking")


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


@dataclass(frozen=True)
class Wire:
    """What one message costs on its way from `src` to `dst`."""

    nbytes: int
    link: str  # a name, for Transfer and Trace.bytes_sent
    seconds: float  # on the wire; the next message of the pair starts after it
    latency: float  # added after the last byte
    burst: float = 0.0  # a token bucket's depth in bytes (0: none); `seconds` is then nbytes / its rate


@dataclass
class TokenBucket:
    """One direction of a link shaped by a token bucket (Linux tc tbf without a peak rate):
    tokens accrue at the link's rate up to ``depth`` bytes while it is idle, and a message
    passes as many bytes at once as there are tokens, the rest at the rate."""

    rate: float  # bytes/s
    depth: float  # bytes
    tokens: Optional[float] = None  # None: full (the link was idle before the run)
    at: float = 0.0  # when `tokens` was counted

    def seconds(self, start: float, nbytes: float) -> float:
        """Wire seconds of ``nbytes`` sent from ``start`` (no earlier than the last send's end)."""
        tokens = self.depth if self.tokens is None else min(self.depth, self.tokens + (start - self.at) * self.rate)
        seconds = max(0.0, nbytes - tokens) / self.rate
        self.tokens, self.at = max(0.0, tokens - nbytes), start + seconds
        return seconds


@dataclass
class ReplayModel:
    """What the replay needs besides the lists."""

    duration: Callable[[Action], float]  # seconds of a compute action at full speed
    wire: Callable[[Action, int, int], Wire]  # (SEND, src, dst) -> its cost on the way
    host_cpu: Optional[Callable[[Action, int, int], float]] = None  # (SEND, src, dst) -> CPU seconds at each end
    semantics: str = "async"
    lookahead: Optional[int] = 1  # async: ticks an irecv is posted ahead (None: all at the start)
    rate: Optional[Callable[[int, Sequence[int]], float]] = None  # (rank, computing ranks) -> speed, 1 if None
    start_times: Optional[tuple[float, ...]] = None  # per rank, default 0


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


def _match(schedule: Schedule, error: type) -> tuple[dict, dict]:
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
                    raise error(f"{a}: no matching send")
                j = q.popleft()
                recv_key[(r, i)] = (a.peer, j)
                send_key[(a.peer, j)] = (a.peer, j)
    left = [k for k, q in sends.items() if q]
    if left:
        raise error(f"sends never received on (src, dst, tag) {left[0]}")
    return recv_key, send_key


def _steps(acts: tuple[Action, ...], semantics: str, interleaved: bool) -> list:
    if semantics == "async":
        return [("one", i) for i in range(len(acts))]
    return megatron_calls(acts, interleaved)


def _post_points(acts: tuple[Action, ...], lookahead: Optional[int]) -> dict:
    """Async posting: action index -> the RECVs whose irecv is posted when it starts."""
    post_at: dict = {}
    first_of_tick: list[tuple[int, int]] = []  # (tick, first index)
    for i, a in enumerate(acts):
        if not first_of_tick or a.tick != first_of_tick[-1][0]:
            first_of_tick.append((a.tick, i))
    for i, a in enumerate(acts):
        if a.kind is not Kind.RECV:
            continue
        at = i
        if lookahead is None:
            at = 0
        else:
            for tick, j in first_of_tick:
                if tick + lookahead >= a.tick:
                    at = min(j, i)
                    break
        post_at.setdefault(at, []).append(i)
    return post_at


def replay(schedule: Schedule, model: ReplayModel, error: type = ScheduleError) -> Trace:
    """Time every action of every rank; `error` is raised (one sentence) for lists that
    do not pair up or that deadlock."""
    if model.semantics not in POSTING_RULES:
        raise error(f"unknown posting rule {model.semantics!r}")
    P = schedule.num_ranks
    lists = schedule.ranks
    recv_key, send_key = _match(schedule, error)
    msgs: dict[tuple[int, int], _Msg] = {}
    for (r, i), key in recv_key.items():
        m = msgs.setdefault(key, _Msg(src=key[0], j=key[1]))
        m.dst, m.i = r, i
    channel_free: dict[tuple[int, int], float] = defaultdict(float)
    buckets: dict[tuple[int, int], TokenBucket] = {}
    heap: list = []
    transfers: list[Transfer] = []
    interleaved = schedule.virtual_stages > 1
    ranks = [_Rank(steps=_steps(lists[r], model.semantics, interleaved)) for r in range(P)]
    work = [0.0] * P
    finish = [0.0] * P
    clock0 = model.start_times or (0.0,) * P

    if model.semantics == "async":
        for r in range(P):
            ranks[r].post_at = _post_points(lists[r], model.lookahead)

    def try_start(m: _Msg) -> None:
        if m.send_post is None or m.recv_post is None or m.end is not None:
            return
        a = lists[m.src][m.j]
        w = model.wire(a, m.src, m.dst)
        ready = max(m.send_post, m.recv_post)
        start = max(ready, channel_free[(m.src, m.dst)])
        seconds = w.seconds
        if w.burst > 0 and w.seconds > 0:
            bucket = buckets.setdefault((m.src, m.dst), TokenBucket(w.nbytes / w.seconds, w.burst))
            seconds = bucket.seconds(start, w.nbytes)
        channel_free[(m.src, m.dst)] = start + seconds
        m.end = start + seconds + w.latency
        transfers.append(Transfer(m.src, m.dst, a.flow, w.nbytes, w.link, ready, start, m.end))
        heapq.heappush(heap, (m.end, m.src, m.j))

    def post_send(r: int, j: int, now: float) -> tuple[int, int]:
        key = send_key.get((r, j), (r, j))
        m = msgs.get(key)
        if m is None:
            raise error(f"{lists[r][j]}: never received")
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
        """This side's share of the host CPU a message costs (0 without host_cpu)."""
        if model.host_cpu is None:
            return 0.0
        a = lists[r][i]
        src, dst = (r, a.peer) if a.kind is Kind.SEND else (a.peer, r)
        m = lists[src][send_key.get((r, i), (r, i))[1]] if a.kind is Kind.SEND else lists[src][recv_key[(r, i)][1]]
        return model.host_cpu(m, src, dst)

    def start_compute(st: _Rank, r: int, seconds: float, now: float, tail: bool) -> None:
        st.mode, st.remaining, st.started, st.in_tail = "compute", seconds, now, tail
        work[r] += seconds

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
        rates = {r: (model.rate(r, computing) if model.rate is not None else 1.0) for r in computing}
        candidates = [now + ranks[r].remaining / rates[r] for r in computing]
        if heap:
            candidates.append(heap[0][0])
        candidates += [clock0[r] for r in range(P) if not started[r]]
        if not candidates:
            blocked = [f"rank {r} waits at step {ranks[r].pc}" for r in range(P) if ranks[r].mode == "wait"]
            raise error("deadlock in replay: " + "; ".join(blocked))
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
