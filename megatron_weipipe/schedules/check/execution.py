"""Run per-rank action lists against each other with blocking-receive semantics.

Two semantics, each a set of `Rules` the walker (walker.py) runs: "buffered" (below:
gloo's, sends never wait) and "nccl" (nccl.py: the lists as the runtime posts them,
operations on one communicator in posting order, a send and its receive complete
together, a batch as a whole).

SEND is asynchronous (it never waits); RECV waits until the matching SEND, the next
unmatched one from that peer with that tag, has been issued. Matching is per
(source, destination, tag) in issue order, which is how gloo and NCCL pair
point-to-point messages. The validator (validate.py) checks symbolic buffer contents
through `walk`.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from megatron_weipipe.schedules.ir.actions import Action, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.ir.posts import programs
from megatron_weipipe.schedules.check.nccl import nccl_walk
from megatron_weipipe.schedules.check.walker import Visit, run_to_end

SEMANTICS = ("buffered", "nccl")


class BufferedRules:
    """gloo's point-to-point rules over the action lists themselves: a SEND is queued at
    once, a RECV runs when its message is queued."""

    def __init__(self, schedule: Schedule, visit: Visit):
        self.lists = schedule.ranks
        self.num_ranks = schedule.num_ranks
        self.visit = visit
        self.pc = [0] * self.num_ranks
        self.queues: dict[tuple[int, int, int], deque[Action]] = {}  # (src, dst, tag) -> sends not received

    def step(self, rank: int) -> bool:
        actions = self.lists[rank]
        if self.pc[rank] >= len(actions):
            return False
        action = actions[self.pc[rank]]
        matched = None
        if action.kind is Kind.RECV:
            if not 0 <= action.peer < self.num_ranks:
                raise ScheduleError(f"{action}: peer {action.peer} is not a rank of the ring")
            q = self.queues.get((action.peer, rank, action.tag))
            if not q:
                return False
            matched = q.popleft()
        elif action.kind is Kind.SEND:
            if not 0 <= action.peer < self.num_ranks or action.peer == rank:
                raise ScheduleError(f"{action}: invalid destination {action.peer}")
            self.queues.setdefault((rank, action.peer, action.tag), deque()).append(action)
        self.visit(action, matched)
        self.pc[rank] += 1
        return True

    def settle(self) -> bool:
        return False  # nothing completes between steps: a queued send is already deliverable

    def done(self) -> bool:
        return all(pc == len(actions) for pc, actions in zip(self.pc, self.lists))

    def deadlock(self) -> ScheduleError:
        blocked = [f"rank {r} waits at {self.lists[r][pc]}" for r, pc in enumerate(self.pc)
                   if pc < len(self.lists[r])]
        return ScheduleError("deadlock: no rank can proceed; " + "; ".join(blocked))

    def finish(self) -> None:
        leftover = [q[0] for q in self.queues.values() if q]
        if leftover:
            raise ScheduleError(
                f"{len(leftover)} message stream(s) never received, first unmatched send: {leftover[0]}"
            )


def walk(schedule: Schedule, visit: Visit, *, semantics: str = "buffered", order: Optional[str] = None,
         lookahead: int = 1) -> None:
    """Call `visit(action, matched_send)` for every action in an order the ranks could
    really execute them in (matched_send is set for RECVs). Raises ScheduleError on
    deadlock or on messages left unreceived. `order` and `lookahead` choose the posting
    program (posts.py) under "nccl"."""
    if semantics == "nccl":
        nccl_walk(schedule, programs(schedule, order, lookahead), visit)
    elif semantics == "buffered":
        run_to_end(BufferedRules(schedule, visit))
    else:
        raise ScheduleError(f"unknown semantics {semantics!r}; choose {' or '.join(SEMANTICS)}")
