"""The one walker of per-rank programs: in which order the ranks' steps run.

Every interpreter of the action lists runs its ranks through `run_until_blocked`: the
buffered check (execution.py, gloo's rules), the NCCL check (nccl.py, over posts.py's
programs) and the timed replay (timing/replay.py, at each instant of its clock). Each
brings its `Rules`, which say whether a rank's next step can run now (a receive whose
message is not there, an operation behind another on its communicator, a compute still
running) and what running it does (symbolic contents, pairing checks, timing). The
walker owns the order: ranks in turn, each as far as it can go, then whatever has
become complete, until nothing moves.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from megatron_weipipe.schedules.ir.actions import Action, ScheduleError

Visit = Callable[[Action, Optional[Action]], None]  # (action, the SEND a RECV was matched with)


class Rules(Protocol):
    """How one kind of execution runs a rank's next step."""

    num_ranks: int

    def step(self, rank: int) -> bool:
        """Run `rank`'s next step if it can run now; False when blocked or finished."""

    def settle(self) -> bool:
        """Complete what has become complete (messages, waits); True if anything did."""


class CheckedRules(Rules, Protocol):
    """Rules of an untimed check: the run must end with every rank at its end."""

    def done(self) -> bool:
        """Every rank ran its whole program and nothing is still in flight."""

    def deadlock(self) -> ScheduleError:
        """The error naming every blocked rank and what it waits for."""

    def finish(self) -> None:
        """Checks on what is left once every rank is done (raise ScheduleError)."""


def run_until_blocked(rules: Rules) -> bool:
    """Settle, then step every rank as far as it goes, in rank order, until nothing
    moves; True if any step ran or anything settled."""
    moved = False
    progressed = True
    while progressed:
        progressed = rules.settle()
        for rank in range(rules.num_ranks):
            while rules.step(rank):
                progressed = True
        moved = moved or progressed
    return moved


def run_to_end(rules: CheckedRules) -> None:
    """Run an untimed check to its end; ScheduleError on deadlock or on what is left."""
    run_until_blocked(rules)
    if not rules.done():
        raise rules.deadlock()
    rules.finish()
