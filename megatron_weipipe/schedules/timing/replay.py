"""The one event core: replay per-rank action lists in time.

Both the tick simulator (tick_simulator.py: unit costs, free or per-message communication)
and the cluster projection (simulator/cluster_replay.py: devices, links, hosts with shared
cores) run the lists through `replay` below; they differ only in the `ReplayModel`
they pass. This module defines the timed types they share (`TimedAction`, `Transfer`,
`Trace`). The order in which ranks step at one instant is the walker's
(check/walker.py); `_Replay` is its rules with a clock.

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

import enum
import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Action, Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.check.calls import CallStep, OneAction, P2PCall, megatron_calls
from megatron_weipipe.schedules.check.walker import run_until_blocked

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


MsgKey = tuple[int, int]  # (sender rank, index of its SEND)


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


class Mode(enum.Enum):
    """What a rank is doing at the replay's current instant."""

    READY = "ready"  # can start its next step
    COMPUTE = "compute"  # a compute action (or a message's host CPU) is running
    WAIT = "wait"  # blocked until messages are delivered
    DONE = "done"  # list finished and its sends delivered


@dataclass
class _Rank:
    steps: list[CallStep]
    pc: int = 0
    mode: Mode = Mode.READY
    remaining: float = 0.0  # compute work left, at full speed
    started: float = 0.0
    waiting: set[MsgKey] = field(default_factory=set)
    wait_from: float = 0.0
    wait_actions: list[int] = field(default_factory=list)
    timed: list[TimedAction] = field(default_factory=list)
    post_at: dict[int, list[int]] = field(default_factory=dict)  # action index -> RECVs whose irecv is posted there
    drained: bool = False
    tail: float = 0.0  # host CPU the finished wait's messages still cost (gloo copies), run after it
    in_tail: bool = False

    def wait(self, keys: set[MsgKey], now: float, actions: list[int]) -> None:
        self.mode, self.waiting, self.wait_from, self.wait_actions = Mode.WAIT, keys, now, actions


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


def _steps(acts: tuple[Action, ...], semantics: str, interleaved: bool) -> list[CallStep]:
    if semantics == "async":
        return [OneAction(i) for i in range(len(acts))]
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


class _Replay:
    """The replay's state at its clock `now`; as the walker's rules (walker.py) a rank
    steps while it is READY, and `settle` releases the waits whose messages arrived."""

    def __init__(self, schedule: Schedule, model: ReplayModel, error: type):
        self.model, self.error = model, error
        self.num_ranks = P = schedule.num_ranks
        self.lists = schedule.ranks
        self.recv_key, self.send_key = _match(schedule, error)
        self.msgs: dict[MsgKey, _Msg] = {}
        for (r, i), key in self.recv_key.items():
            m = self.msgs.setdefault(key, _Msg(src=key[0], j=key[1]))
            m.dst, m.i = r, i
        self.channel_free: dict[tuple[int, int], float] = defaultdict(float)
        self.buckets: dict[tuple[int, int], TokenBucket] = {}
        self.heap: list[tuple[float, int, int]] = []  # (delivery time, src, SEND index)
        self.transfers: list[Transfer] = []
        interleaved = schedule.virtual_stages > 1
        self.ranks = [_Rank(steps=_steps(self.lists[r], model.semantics, interleaved)) for r in range(P)]
        if model.semantics == "async":
            for r in range(P):
                self.ranks[r].post_at = _post_points(self.lists[r], model.lookahead)
        self.work = [0.0] * P
        self.finish = [0.0] * P
        self.clock0 = model.start_times or (0.0,) * P
        self.started = [False] * P
        self.now = 0.0

    # ------------------------------------------------------------------ messages

    def _try_start(self, m: _Msg) -> None:
        if m.send_post is None or m.recv_post is None or m.end is not None:
            return
        a = self.lists[m.src][m.j]
        w = self.model.wire(a, m.src, m.dst)
        ready = max(m.send_post, m.recv_post)
        start = max(ready, self.channel_free[(m.src, m.dst)])
        seconds = w.seconds
        if w.burst > 0 and w.seconds > 0:
            bucket = self.buckets.setdefault((m.src, m.dst), TokenBucket(w.nbytes / w.seconds, w.burst))
            seconds = bucket.seconds(start, w.nbytes)
        self.channel_free[(m.src, m.dst)] = start + seconds
        m.end = start + seconds + w.latency
        self.transfers.append(Transfer(m.src, m.dst, a.flow, w.nbytes, w.link, ready, start, m.end))
        heapq.heappush(self.heap, (m.end, m.src, m.j))

    def _post_send(self, r: int, j: int) -> MsgKey:
        key = self.send_key.get((r, j), (r, j))
        m = self.msgs.get(key)
        if m is None:
            raise self.error(f"{self.lists[r][j]}: never received")
        m.send_post = self.now
        self._try_start(m)
        return key

    def _post_recv(self, r: int, i: int) -> MsgKey:
        key = self.recv_key[(r, i)]
        m = self.msgs[key]
        if m.recv_post is None:
            m.recv_post = self.now
            self._try_start(m)
        return key

    def _comm_cpu(self, r: int, i: int) -> float:
        """This side's share of the host CPU a message costs (0 without host_cpu)."""
        if self.model.host_cpu is None:
            return 0.0
        a = self.lists[r][i]
        if a.kind is Kind.SEND:
            src, dst, j = r, a.peer, self.send_key.get((r, i), (r, i))[1]
        else:
            src, dst, j = a.peer, r, self.recv_key[(r, i)][1]
        return self.model.host_cpu(self.lists[src][j], src, dst)

    # ------------------------------------------------------------------ walker rules

    def step(self, r: int) -> bool:
        """Start rank r's next step if it is READY (and its clock has started)."""
        st = self.ranks[r]
        if not self.started[r] or st.mode is not Mode.READY:
            return False
        if st.pc >= len(st.steps):
            self._end_of_list(r, st)
        elif isinstance(st.steps[st.pc], P2PCall):
            self._call(r, st, st.steps[st.pc].ops)
        else:
            self._one(r, st, st.steps[st.pc].index)
        return True

    def settle(self) -> bool:
        """Release every wait whose messages are all delivered."""
        released = False
        for r, st in enumerate(self.ranks):
            if st.mode is Mode.WAIT and all(self.msgs[k].done for k in st.waiting):
                for i in st.wait_actions:
                    st.timed.append(TimedAction(self.lists[r][i], st.wait_from, self.now))
                st.mode, st.waiting, st.wait_actions = Mode.READY, set(), []
                if st.tail > 0:
                    self._start_compute(st, r, st.tail, tail=True)
                    st.tail = 0.0
                released = True
        return released

    def _end_of_list(self, r: int, st: _Rank) -> None:
        """The list is done: wait once for the rank's own sends, then finish."""
        own = [k for k, m in self.msgs.items() if k[0] == r and not m.done]
        if own and not st.drained:
            st.wait(set(own), self.now, [])
            st.drained = True
            return
        st.mode = Mode.DONE
        self.finish[r] = self.now

    def _call(self, r: int, st: _Rank, ops: tuple[int, ...]) -> None:
        """A blocking p2p call: post all its operations, wait for all of them."""
        keys = set()
        for i in ops:
            keys.add(self._post_send(r, i) if self.lists[r][i].kind is Kind.SEND else self._post_recv(r, i))
        st.wait(keys, self.now, list(ops))
        st.tail = sum(self._comm_cpu(r, i) for i in ops)
        st.pc += 1

    def _one(self, r: int, st: _Rank, i: int) -> None:
        """Action i alone: its irecvs posted ahead, then a send, a receive or a compute."""
        for k in st.post_at.get(i, ()):
            self._post_recv(r, k)
        a = self.lists[r][i]
        if a.kind is Kind.SEND:
            self._post_send(r, i)
            cw = self._comm_cpu(r, i)
            if cw > 0:
                self._start_compute(st, r, cw, tail=False)
                return
        elif a.kind is Kind.RECV:
            st.wait({self._post_recv(r, i)}, self.now, [i])
            st.tail = self._comm_cpu(r, i)
            st.pc += 1
            return
        elif a.kind in COMPUTE_KINDS and self.model.duration(a) > 0:
            self._start_compute(st, r, self.model.duration(a), tail=False)
            return
        st.timed.append(TimedAction(a, self.now, self.now))
        st.pc += 1

    def _start_compute(self, st: _Rank, r: int, seconds: float, tail: bool) -> None:
        st.mode, st.remaining, st.started, st.in_tail = Mode.COMPUTE, seconds, self.now, tail
        self.work[r] += seconds

    # ------------------------------------------------------------------ the clock

    def run(self) -> Trace:
        P = self.num_ranks
        while True:
            for r in range(P):
                if not self.started[r] and self.clock0[r] <= self.now + EPS:
                    self.started[r] = True
            run_until_blocked(self)
            if all(st.mode is Mode.DONE for st in self.ranks):
                break
            computing = [r for r in range(P) if self.ranks[r].mode is Mode.COMPUTE]
            rates = {r: (self.model.rate(r, computing) if self.model.rate is not None else 1.0) for r in computing}
            self._advance_to(self._next_event(computing, rates), computing, rates)
        return Trace(
            per_rank=tuple(tuple(st.timed) for st in self.ranks),
            transfers=tuple(sorted(self.transfers, key=lambda t: (t.start, t.src))),
            finish=tuple(self.finish),
            work=tuple(self.work),
        )

    def _next_event(self, computing: list[int], rates: dict[int, float]) -> float:
        """The next compute end, delivery or rank start; the error if there is none."""
        candidates = [self.now + self.ranks[r].remaining / rates[r] for r in computing]
        if self.heap:
            candidates.append(self.heap[0][0])
        candidates += [self.clock0[r] for r in range(self.num_ranks) if not self.started[r]]
        if not candidates:
            blocked = [f"rank {r} waits at step {st.pc}" for r, st in enumerate(self.ranks) if st.mode is Mode.WAIT]
            raise self.error("deadlock in replay: " + "; ".join(blocked))
        return max(min(candidates), self.now)

    def _advance_to(self, t: float, computing: list[int], rates: dict[int, float]) -> None:
        """Move the clock to t: run the computes, deliver messages, end computes that are done."""
        for r in computing:
            self.ranks[r].remaining -= (t - self.now) * rates[r]
        self.now = t
        while self.heap and self.heap[0][0] <= self.now + EPS:
            _, src, j = heapq.heappop(self.heap)
            self.msgs[(src, j)].done = True
        for r in computing:
            st = self.ranks[r]
            if st.remaining <= EPS * max(1.0, self.now):
                st.mode, st.remaining = Mode.READY, 0.0
                if st.in_tail:  # the CPU side of messages already received: no action of its own
                    st.in_tail = False
                    continue
                a = self.lists[r][st.steps[st.pc].index]
                st.timed.append(TimedAction(a, st.started, self.now))
                st.pc += 1


def replay(schedule: Schedule, model: ReplayModel, error: type = ScheduleError) -> Trace:
    """Time every action of every rank; `error` is raised (one sentence) for lists that
    do not pair up or that deadlock."""
    if model.semantics not in POSTING_RULES:
        raise error(f"unknown posting rule {model.semantics!r}")
    return _Replay(schedule, model, error).run()
