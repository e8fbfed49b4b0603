"""Discrete-event replay of per-rank action lists on devices and links.

The event loop and the timed types are the schedules' own (schedules/timing/replay.py,
which the tick simulator runs too); this module adds the cluster: compute seconds per
action, a link per pair of ranks, hosts whose cores the ranks share.

Two posting rules, one per runtime that executes these lists:

- "async" (WeiPipeRuntime): a SEND is an isend posted where it stands and never waited
  until the end of the rank's list; the irecv of a RECV at tick t is posted when the
  rank starts its first action of tick t - lookahead, and the RECV waits for the data.
- "blocking" (megatron-core's p2p with overlap off, the trainer's setting): the
  SEND/RECV actions form megatron-core's calls (schedules/check/calls.py), for 1F1B and
  interleaved 1F1B alike, each posted together and waited for, sends included, before
  the rank computes again.

A message moves once both its send and its receive are posted (NCCL and gloo both
rendezvous), over the link between the two ranks; messages between the same pair in
the same direction queue behind each other. Compute runs on one stream per rank; on a
CPU host several ranks may share fewer cores than there are ranks (and other jobs), and
then every busy rank on the host progresses at min(1, cores / (busy + background))
(fair processor sharing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_weipipe.schedules.ir.actions import Action, Schedule
from megatron_weipipe.schedules.timing.replay import (
    EPS,
    POSTING_RULES,
    ReplayModel,
    TimedAction,
    Trace,
    Transfer,
    Wire,
)
from megatron_weipipe.schedules.timing.replay import replay as replay_events

from megatron_weipipe.errors import SimulatorError
from megatron_weipipe.simulator.hardware import LinkSpec

__all__ = ["EPS", "EventModel", "TimedAction", "Trace", "Transfer", "replay"]


@dataclass
class EventModel:
    """What the replay needs besides the lists."""

    duration: Callable[[Action], float]  # compute seconds of an action at full speed
    message_bytes: Callable[[Action], int]  # bytes of a SEND
    link: Callable[[int, int], LinkSpec]  # (sender rank, receiver rank) -> link
    semantics: str = "async"  # "async" (WeiPipe runtime) or "blocking" (megatron-core's 1F1B and interleaved)
    lookahead: int = 1
    host_of: Optional[Callable[[int], int]] = None  # rank -> host, for processor sharing
    cores_per_host: Optional[float] = None
    background: float = 0.0  # other CPU-bound tasks on every host
    start_times: Optional[tuple[float, ...]] = None  # per rank, default 0

    def __post_init__(self):
        if self.semantics not in POSTING_RULES:
            raise SimulatorError(f"unknown posting rule {self.semantics!r}")
        if self.lookahead < 0:
            raise SimulatorError("lookahead must be >= 0 ticks")


def _core_model(model: EventModel) -> ReplayModel:
    def wire(send: Action, src: int, dst: int) -> Wire:
        nbytes = int(model.message_bytes(send))
        link = model.link(src, dst)
        return Wire(nbytes, link.name, nbytes / (link.bandwidth_gbs * 1e9), link.latency_us * 1e-6, link.burst_bytes)

    def host_cpu(send: Action, src: int, dst: int) -> float:
        """Each end's half of the host CPU a message costs (0 unless the link says so)."""
        cpb = model.link(src, dst).cpu_s_per_byte
        if not cpb:
            return 0.0
        return 0.5 * cpb * model.message_bytes(send)

    def shared(r: int, computing) -> float:
        """Fair processor sharing of the host's cores."""
        host = model.host_of(r)
        busy = sum(1 for q in computing if model.host_of(q) == host)
        return min(1.0, model.cores_per_host / (max(busy, 1) + model.background))

    sharing = model.cores_per_host is not None and model.host_of is not None
    return ReplayModel(duration=model.duration, wire=wire, host_cpu=host_cpu, semantics=model.semantics,
                       lookahead=model.lookahead, rate=shared if sharing else None, start_times=model.start_times)


def replay(schedule: Schedule, model: EventModel) -> Trace:
    return replay_events(schedule, _core_model(model), error=SimulatorError)
