"""The vocabulary of a schedule: plain, frozen data shared by generator, validator,
simulator, runtime and drawing tools.

A schedule is, per rank, an ordered tuple of `Action`s. The order is the execution
order on that rank; `tick` is the logical step the action belongs to (one hop of every
circulating buffer per tick). Nothing here touches torch, so schedules can be built,
checked and timed without any process group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, tick and action."""


class Kind(str, enum.Enum):
    # buffer bookkeeping (no compute cost)
    LOAD = "load"  # owner casts its fp32 master chunk into a weight buffer (compute dtype)
    DROP = "drop"  # a weight buffer's last use on this rank: free it
    GRAD_INIT = "grad_init"  # start a zeroed gradient token for a chunk
    # compute
    FORWARD = "forward"  # chunk forward of one microbatch (chunk 0 runs pre_fn first)
    LOSS = "loss"  # post_fn (final norm, head, loss) and its backward: dL/dhidden
    BACKWARD = "backward"  # input and weight gradient; weight gradient added to a grads buffer
    BACKWARD_INPUT = "backward_input"  # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "backward_weight"  # weight gradient only, needs no weights
    # communication (SEND is asynchronous; RECV waits for the data)
    SEND = "send"
    RECV = "recv"
    # gradient delivery
    ACCUMULATE_GRAD = "accumulate_grad"  # owner adds a gradient token into its fp32 main grad
    OPTIMIZER_STEP = "optimizer_step"  # owner's gradient of the chunk is final: optimizer may step


COMPUTE_KINDS = frozenset(
    {Kind.FORWARD, Kind.LOSS, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
)
COMM_KINDS = frozenset({Kind.SEND, Kind.RECV})


class Flow(str, enum.Enum):
    """A class of messages. Each flow has its own tag, so flows between the same pair of
    ranks (at ring size 2 the previous and the next rank are one process) never match
    each other's messages."""

    FWD_WEIGHTS = "fwd_weights"
    BWD_WEIGHTS = "bwd_weights"
    GRADS = "grads"
    PLACEMENT = "placement"  # direct owner -> first holder message, lands in a fwd_weights buffer
    ACTIVATIONS = "activations"  # 1F1B timelines only
    ACTIVATION_GRADS = "activation_grads"  # 1F1B timelines only

    @property
    def tag(self) -> int:
        return FLOW_TAGS[self]


FLOW_TAGS: dict[Flow, int] = {
    Flow.FWD_WEIGHTS: 11,
    Flow.BWD_WEIGHTS: 12,
    Flow.GRADS: 13,
    Flow.PLACEMENT: 14,
    Flow.ACTIVATIONS: 21,
    Flow.ACTIVATION_GRADS: 22,
}

# Flows that move one hop r -> r+1 around the ring per tick.
RING_FLOWS = frozenset({Flow.FWD_WEIGHTS, Flow.BWD_WEIGHTS, Flow.GRADS})
WEIGHT_FLOWS = frozenset({Flow.FWD_WEIGHTS, Flow.BWD_WEIGHTS, Flow.PLACEMENT})


@dataclass(frozen=True, order=True)
class Buffer:
    """One slot of a family of circulating buffers on a rank (double-buffered: slot 0/1)."""

    flow: Flow
    slot: int

    def __str__(self) -> str:
        return f"{self.flow.value}[{self.slot}]"


@dataclass(frozen=True)
class Action:
    """One step on one rank.

    - compute: `buffer` is the weight buffer read (None for LOSS, BACKWARD_WEIGHT and
      1F1B timelines); `grad` the grads buffer a weight gradient is added to.
    - LOAD / DROP / GRAD_INIT / ACCUMULATE_GRAD: `buffer` is the buffer acted on.
    - SEND / RECV: `buffer` is the buffer sent from / received into, `peer` the ring
      rank at the other end, `flow` the message class and `tag` its tag.
    `chunk` is the decoder chunk (or pipeline stage for 1F1B) involved, `mb` the
    microbatch index local to the rank (global index for 1F1B timelines).
    """

    kind: Kind
    rank: int
    tick: int
    mb: int = -1
    chunk: int = -1
    buffer: Optional[Buffer] = None
    grad: Optional[Buffer] = None
    peer: int = -1
    flow: Optional[Flow] = None
    tag: int = -1

    def label(self) -> str:
        """Short text used in tick tables: F1.s0, B0.s3, I0.s3 (input grad), W0.s3 (weight grad)."""
        letter = {
            Kind.FORWARD: "F",
            Kind.BACKWARD: "B",
            Kind.BACKWARD_INPUT: "I",
            Kind.BACKWARD_WEIGHT: "W",
            Kind.LOSS: "L",
        }.get(self.kind)
        if letter is None:
            return self.kind.value
        if self.kind is Kind.LOSS:
            return f"L{self.mb}"
        return f"{letter}{self.mb}.s{self.chunk}"

    def __str__(self) -> str:
        parts = [f"{self.kind.value}", f"rank={self.rank}", f"tick={self.tick}"]
        if self.mb >= 0:
            parts.append(f"mb={self.mb}")
        if self.chunk >= 0:
            parts.append(f"chunk={self.chunk}")
        if self.buffer is not None:
            parts.append(f"buffer={self.buffer}")
        if self.grad is not None:
            parts.append(f"grad={self.grad}")
        if self.kind in COMM_KINDS:
            parts.append(f"{'to' if self.kind is Kind.SEND else 'from'}={self.peer}")
            parts.append(f"flow={self.flow.value if self.flow else None}")
            parts.append(f"tag={self.tag}")
        return "(" + " ".join(parts) + ")"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the sizes they were generated for.

    `family` is "weipipe" (ring of `num_ranks`, rank c owns chunk c, each rank runs
    `microbatches` of its own) or "megatron" (1F1B timelines: every stage sees all
    `microbatches`). `slots` is the number of buffer slots per flow on every rank.
    """

    name: str
    family: str
    num_ranks: int
    num_chunks: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    slots: tuple[tuple[Flow, int], ...] = field(default=())
    virtual_stages: int = 1

    def actions(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    def all_actions(self):
        for rank_actions in self.ranks:
            yield from rank_actions

    def slot_count(self, flow: Flow) -> int:
        return dict(self.slots).get(flow, 0)

    def num_ticks(self) -> int:
        """Ticks that hold compute (the makespan in ticks; delivery of the last
        gradient hop to the owner happens in the tick after)."""
        ticks = [a.tick for a in self.all_actions() if a.kind in COMPUTE_KINDS]
        return max(ticks) + 1 if ticks else 0

    def replace_ranks(self, ranks) -> "Schedule":
        """A copy with other action lists (used by tests that mutate schedules)."""
        return Schedule(
            name=self.name,
            family=self.family,
            num_ranks=self.num_ranks,
            num_chunks=self.num_chunks,
            microbatches=self.microbatches,
            ranks=tuple(tuple(r) for r in ranks),
            slots=self.slots,
            virtual_stages=self.virtual_stages,
        )
