"""Run per-rank post programs (posts.py) under NCCL's point-to-point semantics.

What NCCL does, as torch's ProcessGroupNCCL drives it:
- a single isend/irecv runs on the communicator of its pair of ranks (one per process
  group and pair); a batch_isend_irecv (coalescing manager) runs on the group's own
  communicator. Each communicator has one stream per rank: its operations run in
  posting order, an operation starts only when everything posted before it on that
  communicator is done.
- tags are ignored: the k-th send from a to b on a communicator meets the k-th receive
  on b from a on that communicator. A send and its receive complete together, once both
  have started; a batch starts as a whole and completes when all its operations have.
- work.wait() blocks later work of the rank (the compute stream, and every operation
  posted after it, which first waits for the compute stream); here the host blocks.
- the first batch on a group creates its communicator, collectively: every rank of the
  group must reach its first batch.
These are the rules the walker (walker.py) runs the programs under; they report the first deadlock (every blocked rank and what it waits for) and any
message NCCL would pair differently from the tag-based intent (silent corruption).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_weipipe.schedules.ir.actions import Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.ir.posts import Post, Step, Wait, pair_messages
from megatron_weipipe.schedules.check.walker import Visit, run_to_end

Op = tuple[int, int]  # (rank, action index) of a SEND or RECV


@dataclass(frozen=True)
class Communicator:
    """A batch runs on its group's communicator (`pair` None), a single operation on the
    communicator of its pair of ranks within the group."""

    group: str
    pair: Optional[tuple[int, int]] = None

    @staticmethod
    def of(rank: int, peer: int, post: Post) -> "Communicator":
        return Communicator(post.group) if post.batched else Communicator(post.group, (min(rank, peer), max(rank, peer)))

    def describe(self) -> str:
        if self.pair is None:
            return f"the {self.group} group's communicator"
        return f"the {self.group} pair communicator of ranks {self.pair[0]} and {self.pair[1]}"


@dataclass(frozen=True)
class _Unit:
    """What NCCL runs as one: a single operation or a whole batch."""

    rank: int
    ops: tuple[int, ...]
    comm: Communicator


class NcclRules:
    """NCCL's point-to-point rules over per-rank post programs (posts.py)."""

    def __init__(self, schedule: Schedule, programs: Sequence[list[Step]], visit: Optional[Visit] = None):
        self.schedule = schedule
        self.num_ranks = schedule.num_ranks
        self.lists = schedule.ranks
        self.programs = programs
        self.visit = visit or (lambda a, m: None)
        self.intended = pair_messages(schedule)
        self.pc = [0] * self.num_ranks
        self.unit_of: dict[Op, int] = {}  # op -> unit id
        self.units: list[_Unit] = []
        self.streams: dict[tuple[int, Communicator], deque[int]] = defaultdict(deque)  # unit ids per stream
        self.posted: dict[tuple, list[Op]] = defaultdict(list)  # (src, dst, comm, 'S'|'R') -> ops in order
        self.partner: dict[Op, Op] = {}
        self.arrived: dict[str, set[int]] = defaultdict(set)  # batch group -> ranks at their first batch
        self.done_units: set[int] = set()

    # ------------------------------------------------------------------ walker rules

    def step(self, r: int) -> bool:
        prog = self.programs[r]
        if self.pc[r] >= len(prog):
            return False
        step = prog[self.pc[r]]
        if isinstance(step, Post):
            if not self._post(r, step):
                return False
        elif isinstance(step, Wait):
            if not all(self._is_done(r, i) for i in step.ops):
                return False
        else:
            a = self.lists[r][step]
            if a.kind is Kind.RECV:
                if not self._is_done(r, step):
                    return False
                s = self.partner[(r, step)]
                self.visit(a, self.lists[s[0]][s[1]])
            else:
                self.visit(a, None)
        self.pc[r] += 1
        return True

    def settle(self) -> bool:
        """Complete every stream head whose operations all met their partners at a head."""
        heads = {q[0] for q in self.streams.values() if q}
        finished = [u for u in heads if all(self._met_at_head(self.units[u].rank, i, heads) for i in self.units[u].ops)]
        for u in finished:
            self.done_units.add(u)
            self.streams[(self.units[u].rank, self.units[u].comm)].popleft()
        return bool(finished)

    def done(self) -> bool:
        return (all(pc == len(prog) for pc, prog in zip(self.pc, self.programs))
                and len(self.done_units) == len(self.units))

    def deadlock(self) -> ScheduleError:
        stuck = [self._blocked_at(r) for r in range(self.num_ranks)
                 if self.pc[r] < len(self.programs[r]) or self._open_ops(r)]
        return ScheduleError(f"{self.schedule.name} P={self.num_ranks}: deadlock under NCCL semantics: "
                             + "; ".join(stuck))

    def finish(self) -> None:
        missing = [a for r, acts in enumerate(self.lists) for i, a in enumerate(acts)
                   if a.kind in (Kind.SEND, Kind.RECV) and (r, i) not in self.unit_of]
        if missing:
            raise ScheduleError(f"{missing[0]}: never posted")

    # ------------------------------------------------------------------ posting and pairing

    def _post(self, r: int, step: Post) -> bool:
        if step.batched:
            self.arrived[step.group].add(r)
            if len(self.arrived[step.group]) < self.num_ranks:
                return False  # communicator creation waits for every rank
        for ops in ([step.ops] if step.batched else [(i,) for i in step.ops]):
            uid = len(self.units)
            comms = {self._post_op(r, i, step, uid) for i in ops}
            self.units.append(_Unit(r, ops, comms.pop()))
            self.streams[(r, self.units[-1].comm)].append(uid)
        return True

    def _post_op(self, r: int, i: int, step: Post, uid: int) -> Communicator:
        a = self.lists[r][i]
        if a.kind not in (Kind.SEND, Kind.RECV):
            raise ScheduleError(f"{a}: posted as a message")
        if (r, i) in self.unit_of:
            raise ScheduleError(f"{a}: posted twice")
        c = Communicator.of(r, a.peer, step)
        self.unit_of[(r, i)] = uid
        src, dst = (r, a.peer) if a.kind is Kind.SEND else (a.peer, r)
        mine, other = ("S", "R") if a.kind is Kind.SEND else ("R", "S")
        k = len(self.posted[(src, dst, c, mine)])
        self.posted[(src, dst, c, mine)].append((r, i))
        theirs = self.posted[(src, dst, c, other)]
        if k < len(theirs):
            self._pair(theirs[k], (r, i))
        return c

    def _pair(self, x: Op, y: Op) -> None:
        s, rv = (x, y) if self.lists[x[0]][x[1]].kind is Kind.SEND else (y, x)
        if self.intended.get(s) != rv:
            raise ScheduleError(
                f"NCCL pairs {self.lists[s[0]][s[1]]} with {self.lists[rv[0]][rv[1]]} (tags are ignored, order on "
                "the communicator decides), but the schedule means them for other messages")
        self.partner[s], self.partner[rv] = rv, s

    def _met_at_head(self, r: int, i: int, heads: set[int]) -> bool:
        """Op (r, i) has its partner, and the partner's unit is at the head of its stream."""
        p = self.partner.get((r, i))
        return p is not None and self.unit_of[p] in heads

    def _is_done(self, r: int, i: int) -> bool:
        u = self.unit_of.get((r, i))
        return u is not None and u in self.done_units

    def _open_ops(self, r: int) -> list[int]:
        """Rank r's posted operations not yet complete."""
        return [i for (rr, i) in self.unit_of if rr == r and not self._is_done(rr, i)]

    def _blocked_at(self, r: int) -> str:
        step = self.programs[r][self.pc[r]] if self.pc[r] < len(self.programs[r]) else None
        if isinstance(step, Post):
            return f"rank {r} waits for every rank to reach its first batch on the {step.group} group"
        ops = (step,) if isinstance(step, int) else (step.ops if step is not None else
                                                    tuple(i for (rr, i) in self.unit_of if rr == r))
        for i in ops:
            if not self._is_done(r, i):
                a = self.lists[r][i]
                u = self.unit_of.get((r, i))
                if u is None:
                    return f"rank {r} waits at {a}, never posted"
                head = self.streams[(r, self.units[u].comm)][0]
                ahead = "" if head == u else f" behind {self.lists[r][self.units[head].ops[0]]}"
                return f"rank {r} waits at {a} on {self.units[u].comm.describe()}{ahead}"
        return f"rank {r} is blocked"


def nccl_walk(schedule: Schedule, programs: Sequence[list[Step]], visit: Optional[Visit] = None) -> None:
    """Execute `programs[r]` (rank r's steps) under NCCL semantics; `visit(action,
    matched_send)` is called in an order the ranks could run them. Raises ScheduleError."""
    run_to_end(NcclRules(schedule, programs, visit))
