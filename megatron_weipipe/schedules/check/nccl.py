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
The walker reports the first deadlock (every blocked rank and what it waits for) and any
message NCCL would pair differently from the tag-based intent (silent corruption).
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Optional, Sequence

from megatron_weipipe.schedules.ir.actions import Action, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.ir.posts import Post, Step, Wait, pair_messages

Visit = Callable[[Action, Optional[Action]], None]


def _comm(rank: int, peer: int, post: Post) -> tuple:
    if post.batched:
        return ("batch", post.group)
    return ("pair", post.group, min(rank, peer), max(rank, peer))


def _describe(comm: tuple) -> str:
    if comm[0] == "batch":
        return f"the {comm[1]} group's communicator"
    return f"the {comm[1]} pair communicator of ranks {comm[2]} and {comm[3]}"


def nccl_walk(schedule: Schedule, programs: Sequence[list[Step]], visit: Optional[Visit] = None) -> None:
    """Execute `programs[r]` (rank r's steps) under NCCL semantics; `visit(action,
    matched_send)` is called in an order the ranks could run them. Raises ScheduleError."""
    P = schedule.num_ranks
    lists = schedule.ranks
    intended = pair_messages(schedule)
    visit = visit or (lambda a, m: None)
    pc = [0] * P
    unit_of: dict[tuple[int, int], int] = {}  # (rank, action index) -> unit id
    units: list[dict] = []
    streams: dict[tuple, deque] = defaultdict(deque)  # (rank, comm) -> unit ids
    posted: dict[tuple, list] = defaultdict(list)  # (src, dst, comm, 'S'|'R') -> [(rank, index)]
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    arrived: dict[str, set] = defaultdict(set)  # batch group -> ranks at their first batch
    done_units: set[int] = set()

    def post(r: int, step: Post) -> bool:
        if step.batched and r not in arrived[step.group]:
            arrived[step.group].add(r)
        if step.batched and len(arrived[step.group]) < P:
            return False  # communicator creation waits for every rank
        groups = [step.ops] if step.batched else [(i,) for i in step.ops]
        for ops in groups:
            uid = len(units)
            comms = set()
            for i in ops:
                a = lists[r][i]
                if a.kind not in (Kind.SEND, Kind.RECV):
                    raise ScheduleError(f"{a}: posted as a message")
                if (r, i) in unit_of:
                    raise ScheduleError(f"{a}: posted twice")
                c = _comm(r, a.peer, step)
                comms.add(c)
                unit_of[(r, i)] = uid
                src, dst = (r, a.peer) if a.kind is Kind.SEND else (a.peer, r)
                mine, other = ("S", "R") if a.kind is Kind.SEND else ("R", "S")
                k = len(posted[(src, dst, c, mine)])
                posted[(src, dst, c, mine)].append((r, i))
                theirs = posted[(src, dst, c, other)]
                if k < len(theirs):
                    _pair(theirs[k], (r, i))
            units.append({"rank": r, "ops": ops, "comm": comms.pop()})
            streams[(r, units[-1]["comm"])].append(uid)
        return True

    def _pair(x: tuple[int, int], y: tuple[int, int]) -> None:
        s, rv = (x, y) if lists[x[0]][x[1]].kind is Kind.SEND else (y, x)
        if intended.get(s) != rv:
            raise ScheduleError(
                f"NCCL pairs {lists[s[0]][s[1]]} with {lists[rv[0]][rv[1]]} (tags are ignored, order on "
                "the communicator decides), but the schedule means them for other messages")
        partner[s], partner[rv] = rv, s

    def is_done(r: int, i: int) -> bool:
        u = unit_of.get((r, i))
        return u is not None and u in done_units

    def complete() -> bool:
        heads = {q[0] for q in streams.values() if q}
        finished = []
        for u in heads:
            ok = True
            for i in units[u]["ops"]:
                p = partner.get((units[u]["rank"], i))
                if p is None or unit_of[p] not in heads:
                    ok = False
                    break
            if ok:
                finished.append(u)
        for u in finished:
            done_units.add(u)
            streams[(units[u]["rank"], units[u]["comm"])].popleft()
        return bool(finished)

    def blocked_at(r: int) -> str:
        step = programs[r][pc[r]] if pc[r] < len(programs[r]) else None
        if isinstance(step, Post):
            return f"rank {r} waits for every rank to reach its first batch on the {step.group} group"
        ops = (step,) if isinstance(step, int) else (step.ops if step is not None else
                                                    tuple(i for (rr, i) in unit_of if rr == r))
        for i in ops:
            if not is_done(r, i):
                a = lists[r][i]
                u = unit_of.get((r, i))
                if u is None:
                    return f"rank {r} waits at {a}, never posted"
                head = streams[(r, units[u]['comm'])][0]
                ahead = "" if head == u else f" behind {lists[r][units[head]['ops'][0]]}"
                return f"rank {r} waits at {a} on {_describe(units[u]['comm'])}{ahead}"
        return f"rank {r} is blocked"

    while True:
        progressed = False
        for r in range(P):
            prog = programs[r]
            while pc[r] < len(prog):
                step = prog[pc[r]]
                if isinstance(step, Post):
                    if not post(r, step):
                        break
                elif isinstance(step, Wait):
                    if not all(is_done(r, i) for i in step.ops):
                        break
                else:
                    a = lists[r][step]
                    if a.kind is Kind.RECV:
                        if not is_done(r, step):
                            break
                        s = partner[(r, step)]
                        visit(a, lists[s[0]][s[1]])
                    else:
                        visit(a, None)
                pc[r] += 1
                progressed = True
        progressed = complete() or progressed
        if all(pc[r] == len(programs[r]) for r in range(P)) and len(done_units) == len(units):
            break
        if not progressed:
            stuck = [blocked_at(r) for r in range(P)
                     if pc[r] < len(programs[r]) or any(not is_done(rr, i) for (rr, i) in unit_of if rr == r)]
            raise ScheduleError(f"{schedule.name} P={P}: deadlock under NCCL semantics: " + "; ".join(stuck))
    missing = [a for r in range(P) for i, a in enumerate(lists[r])
               if a.kind in (Kind.SEND, Kind.RECV) and (r, i) not in unit_of]
    if missing:
        raise ScheduleError(f"{missing[0]}: never posted")
