"""Run per-rank action lists against each other with blocking-receive semantics.

Two semantics: "buffered" (below: gloo's, sends never wait) and "nccl" (nccl.py: the
lists as the runtime posts them, operations on one communicator in posting order, a
send and its receive complete together, a batch as a whole).

SEND is asynchronous (it never waits); RECV waits until the matching SEND, the next
unmatched one from that peer with that tag, has been issued. Matching is per
(source, destination, tag) in issue order, which is how gloo and NCCL pair
point-to-point messages. This one walker serves the validator (symbolic buffer
contents), the timing simulator and deadlock detection.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from megatron_weipipe.schedules.ir.actions import Action, Kind, Schedule, ScheduleError

Visit = Callable[[Action, Optional[Action]], None]


def walk(schedule: Schedule, visit: Visit, *, semantics: str = "buffered", order: Optional[str] = None,
         lookahead: int = 1) -> None:
    """Call `visit(action, matched_send)` for every action in an order the ranks could
    really execute them in (matched_send is set for RECVs). Raises ScheduleError on
    deadlock or on messages left unreceived. `order` and `lookahead` choose the posting
    program (posts.py) under "nccl"."""
    if semantics == "nccl":
        from megatron_weipipe.schedules.check.nccl import nccl_walk
        from megatron_weipipe.schedules.ir.posts import programs

        nccl_walk(schedule, programs(schedule, order, lookahead), visit)
        return
    if semantics != "buffered":
        raise ScheduleError(f"unknown semantics {semantics!r}; choose buffered or nccl")
    P = schedule.num_ranks
    pc = [0] * P
    queues: dict[tuple[int, int, int], deque] = {}
    lists = schedule.ranks
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for rank in range(P):
            actions = lists[rank]
            while pc[rank] < len(actions):
                action = actions[pc[rank]]
                matched = None
                if action.kind is Kind.RECV:
                    if not 0 <= action.peer < P:
                        raise ScheduleError(f"{action}: peer {action.peer} is not a rank of the ring")
                    q = queues.get((action.peer, rank, action.tag))
                    if not q:
                        break
                    matched = q.popleft()
                elif action.kind is Kind.SEND:
                    if not 0 <= action.peer < P or action.peer == rank:
                        raise ScheduleError(f"{action}: invalid destination {action.peer}")
                    queues.setdefault((rank, action.peer, action.tag), deque()).append(action)
                visit(action, matched)
                pc[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [
                f"rank {r} waits at {lists[r][pc[r]]}" for r in range(P) if pc[r] < len(lists[r])
            ]
            raise ScheduleError("deadlock: no rank can proceed; " + "; ".join(blocked))
    leftover = [q[0] for q in queues.values() if q]
    if leftover:
        raise ScheduleError(
            f"{len(leftover)} message stream(s) never received, first unmatched send: {leftover[0]}"
        )
