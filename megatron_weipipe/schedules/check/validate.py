"""Check a schedule without any process group.

The validator executes every rank's list symbolically (execution.walk): each buffer
slot holds "weights of chunk c" or "gradient of chunk c with contributions
{(rank, microbatch), ...}", messages carry those contents, and every compute action is
checked against what its buffer truly holds at that moment. This is what catches a
backward that silently runs on the wrong chunk (a wrong routing direction, an
off-by-one in the rotation) even when every send has a matching receive.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from megatron_weipipe.schedules.ir.actions import (
    COMPUTE_KINDS,
    FLOW_TAGS,
    RING_FLOWS,
    Action,
    Buffer,
    Flow,
    Kind,
    Schedule,
    ScheduleError,
)
from megatron_weipipe.schedules.check.execution import walk
from megatron_weipipe.schedules.check.walker import Visit


@dataclass(frozen=True)
class _Weights:
    chunk: int

    def __str__(self) -> str:
        return f"weights of chunk {self.chunk}"


@dataclass
class _Grad:
    chunk: int
    parts: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        return f"gradient of chunk {self.chunk} ({sum(self.parts.values())} contributions)"


def _check_tags(schedule: Schedule) -> None:
    seen: dict[int, Flow] = {}
    for flow, tag in FLOW_TAGS.items():
        if tag in seen:
            raise ScheduleError(f"flows {seen[tag].value} and {flow.value} share tag {tag}")
        seen[tag] = flow
    for a in schedule.all_actions():
        if a.kind in (Kind.SEND, Kind.RECV):
            if a.flow is None:
                raise ScheduleError(f"{a}: message without a flow")
            if a.tag != a.flow.tag:
                raise ScheduleError(
                    f"{a}: tag {a.tag} is not the tag {a.flow.tag} of flow {a.flow.value}; each flow "
                    "needs its own tag (at ring size 2 the previous and next rank are one peer)"
                )


def _check_ticks(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.ranks):
        last = -1
        for a in actions:
            if a.rank != rank:
                raise ScheduleError(f"{a} is listed on rank {rank}")
            if a.tick < last:
                raise ScheduleError(f"{a} comes after an action of tick {last} on rank {rank}")
            last = a.tick


class _RankState:
    def __init__(self, schedule: Schedule, rank: int):
        self.rank = rank
        self.P = schedule.num_ranks
        self.slots = {flow: n for flow, n in schedule.slots}
        self.buffers: dict[Buffer, object] = {}
        self.forward_done: set[tuple[int, int]] = set()
        self.loss_done: set[int] = set()
        self.input_grad_done: set[tuple[int, int]] = set()
        self.weight_grad_done: set[tuple[int, int]] = set()

    def holds(self, a: Action, buf: Optional[Buffer]):
        if buf is None:
            raise ScheduleError(f"{a}: needs a buffer and names none")
        if buf.slot < 0 or buf.slot >= self.slots.get(buf.flow, 0):
            raise ScheduleError(
                f"{a}: buffer {buf} is not one of the {self.slots.get(buf.flow, 0)} {buf.flow.value} slots"
            )
        return self.buffers.get(buf)

    def put(self, a: Action, buf: Buffer, content) -> None:
        old = self.holds(a, buf)
        if old is not None:
            raise ScheduleError(f"{a}: overwrites buffer {buf} on rank {self.rank}, which still holds {old}")
        self.buffers[buf] = content

    def weights(self, a: Action) -> None:
        got = self.holds(a, a.buffer)
        if got != _Weights(a.chunk):
            raise ScheduleError(
                f"{a}: computes with chunk {a.chunk} but buffer {a.buffer} on rank {self.rank} holds "
                f"{got if got is not None else 'nothing'}"
            )

    def add_grad(self, a: Action, owner_steps: set) -> None:
        got = self.holds(a, a.grad)
        if not isinstance(got, _Grad) or got.chunk != a.chunk:
            raise ScheduleError(
                f"{a}: adds a gradient of chunk {a.chunk} to buffer {a.grad} on rank {self.rank}, which holds "
                f"{got if got is not None else 'nothing'}"
            )
        if a.chunk in owner_steps:
            raise ScheduleError(f"{a}: contributes to chunk {a.chunk} after its optimizer step")
        key = (self.rank, a.mb)
        if got.parts[key]:
            raise ScheduleError(f"{a}: microbatch {a.mb} of rank {self.rank} is added to chunk {a.chunk} twice")
        got.parts[key] += 1


def validate(schedule: Schedule, *, check_direction: bool = True, semantics: str = "buffered",
             order: Optional[str] = None, lookahead: int = 1) -> None:
    """Raise ScheduleError naming the first broken rule; return None if the schedule is sound.

    Rules (WeiPipe family): every compute reads the buffer that holds its chunk at that
    moment; forward of (mb, c) follows forward of (mb, c-1), the loss follows the last
    forward, every backward follows its forward and the backward (or loss) above it, on
    the same rank; each of the G*P microbatches' gradients of chunk c reaches owner c
    exactly once before OPTIMIZER_STEP of c; sends and receives pair up per
    (peer pair, tag) in order without deadlock; ring flows move r -> r+1 one hop per
    tick (`check_direction=False` skips only this rule, to show the content check alone
    catches misrouting); no buffer is overwritten while live; nothing leaks.
    Megatron timelines get the generic rules (tags, pairing, deadlock).
    `semantics="nccl"` executes the lists as posted by `order` (posts.py) under NCCL's
    rules (nccl.py) instead of gloo's buffered sends.
    """
    _check_tags(schedule)
    _check_ticks(schedule)
    checker = (_RingChecker(schedule, check_direction) if schedule.family == "weipipe"
               else _ActivationChecker(schedule))
    walk(schedule, checker.visit, semantics=semantics, order=order, lookahead=lookahead)
    checker.finish()


class _RingChecker:
    """WeiPipe lists: symbolic buffer contents, one handler per action kind."""

    def __init__(self, schedule: Schedule, check_direction: bool):
        self.schedule = schedule
        self.check_direction = check_direction
        self.P, self.G = schedule.num_ranks, schedule.microbatches
        self.states = [_RankState(schedule, r) for r in range(self.P)]
        self.in_flight: dict[int, object] = {}  # id(SEND) -> the contents it carries
        self.owner_acc: dict[int, Counter] = {c: Counter() for c in range(schedule.num_chunks)}
        self.owner_steps: set[int] = set()
        self.handlers: dict[Kind, Visit] = {
            Kind.LOAD: self._on_load,
            Kind.DROP: self._on_drop,
            Kind.GRAD_INIT: self._on_grad_init,
            Kind.SEND: self._on_send,
            Kind.RECV: self._on_recv,
            Kind.FORWARD: self._on_forward,
            Kind.LOSS: self._on_loss,
            Kind.BACKWARD: self._on_backward,
            Kind.BACKWARD_INPUT: self._on_backward,
            Kind.BACKWARD_WEIGHT: self._on_backward_weight,
            Kind.ACCUMULATE_GRAD: self._on_accumulate_grad,
            Kind.OPTIMIZER_STEP: self._on_optimizer_step,
        }

    def visit(self, a: Action, matched: Optional[Action]) -> None:
        k = a.kind
        if k in COMPUTE_KINDS and k is not Kind.LOSS and not 0 <= a.chunk < self.schedule.num_chunks:
            raise ScheduleError(f"{a}: chunk {a.chunk} out of range")
        if k in COMPUTE_KINDS and not 0 <= a.mb < self.G:
            raise ScheduleError(f"{a}: microbatch {a.mb} out of range 0..{self.G - 1}")
        handler = self.handlers.get(k)
        if handler is None:
            raise ScheduleError(f"{a}: unknown action kind")
        handler(a, matched)

    # ------------------------------------------------------------------ buffers

    def _on_load(self, a: Action, matched: Optional[Action]) -> None:
        if a.rank != a.chunk:
            raise ScheduleError(f"{a}: rank {a.rank} loads chunk {a.chunk}, which it does not own")
        if a.chunk in self.owner_steps:
            raise ScheduleError(f"{a}: loads chunk {a.chunk} after its optimizer step")
        self.states[a.rank].put(a, a.buffer, _Weights(a.chunk))

    def _on_drop(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        got = st.holds(a, a.buffer)
        if got is None:
            raise ScheduleError(f"{a}: drops an empty buffer")
        if isinstance(got, _Grad):
            raise ScheduleError(f"{a}: drops {got}; gradients must reach their owner")
        st.buffers[a.buffer] = None

    def _on_grad_init(self, a: Action, matched: Optional[Action]) -> None:
        self.states[a.rank].put(a, a.buffer, _Grad(a.chunk))

    # ------------------------------------------------------------------ messages

    def _on_send(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        got = st.holds(a, a.buffer)
        if got is None:
            raise ScheduleError(f"{a}: sends an empty buffer")
        if got.chunk != a.chunk:
            raise ScheduleError(f"{a}: announces chunk {a.chunk} but buffer {a.buffer} holds {got}")
        self.in_flight[id(a)] = got
        st.buffers[a.buffer] = None

    def _on_recv(self, a: Action, matched: Optional[Action]) -> None:
        got = self.in_flight.pop(id(matched))
        if matched.flow is not a.flow:
            raise ScheduleError(f"{a}: receives a {matched.flow.value} message sent by {matched}")
        if a.flow in RING_FLOWS and self.check_direction:
            if a.rank != (matched.rank + 1) % self.P:
                raise ScheduleError(
                    f"{a}: ring flow {a.flow.value} must move r -> r+1, but came from rank {matched.rank}"
                )
            if a.tick != matched.tick + 1:
                raise ScheduleError(f"{a}: a ring hop takes one tick, but it was sent at tick {matched.tick}")
        if a.tick < matched.tick:
            raise ScheduleError(f"{a}: received at an earlier tick than sent by {matched}")
        if got.chunk != a.chunk:
            raise ScheduleError(f"{a}: expects chunk {a.chunk} but the message carries {got}")
        if a.buffer is None or (isinstance(got, _Grad)) != (a.buffer.flow is Flow.GRADS):
            raise ScheduleError(f"{a}: {got} cannot land in buffer {a.buffer}")
        self.states[a.rank].put(a, a.buffer, got)

    # ------------------------------------------------------------------ compute

    def _on_forward(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        st.weights(a)
        if (a.mb, a.chunk) in st.forward_done:
            raise ScheduleError(f"{a}: forward of microbatch {a.mb} chunk {a.chunk} runs twice")
        if a.chunk > 0 and (a.mb, a.chunk - 1) not in st.forward_done:
            raise ScheduleError(f"{a}: runs before the forward of chunk {a.chunk - 1} of that microbatch")
        st.forward_done.add((a.mb, a.chunk))

    def _on_loss(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        if (a.mb, self.schedule.num_chunks - 1) not in st.forward_done:
            raise ScheduleError(f"{a}: loss before the last chunk's forward")
        if a.mb in st.loss_done:
            raise ScheduleError(f"{a}: loss computed twice")
        st.loss_done.add(a.mb)

    def _on_backward(self, a: Action, matched: Optional[Action]) -> None:
        """BACKWARD and BACKWARD_INPUT: the input gradient (and, for BACKWARD, the weight's)."""
        st = self.states[a.rank]
        st.weights(a)
        key = (a.mb, a.chunk)
        if key not in st.forward_done:
            raise ScheduleError(f"{a}: backward before its forward on rank {a.rank}")
        if key in st.input_grad_done:
            raise ScheduleError(f"{a}: backward of microbatch {a.mb} chunk {a.chunk} runs twice")
        last = a.chunk == self.schedule.num_chunks - 1
        above = a.mb in st.loss_done if last else (a.mb, a.chunk + 1) in st.input_grad_done
        if not above:
            raise ScheduleError(f"{a}: runs before the gradient from above (loss or chunk {a.chunk + 1}) exists")
        st.input_grad_done.add(key)
        if a.kind is Kind.BACKWARD:
            st.add_grad(a, self.owner_steps)
            st.weight_grad_done.add(key)

    def _on_backward_weight(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        key = (a.mb, a.chunk)
        if key not in st.input_grad_done:
            raise ScheduleError(f"{a}: weight gradient before the input-gradient pass of that chunk")
        if key in st.weight_grad_done:
            raise ScheduleError(f"{a}: weight gradient computed twice")
        st.add_grad(a, self.owner_steps)
        st.weight_grad_done.add(key)

    # ------------------------------------------------------------------ the owner

    def _on_accumulate_grad(self, a: Action, matched: Optional[Action]) -> None:
        st = self.states[a.rank]
        got = st.holds(a, a.buffer)
        if not isinstance(got, _Grad) or got.chunk != a.chunk:
            raise ScheduleError(f"{a}: expects the gradient of chunk {a.chunk}, buffer holds {got}")
        if a.rank != a.chunk:
            raise ScheduleError(f"{a}: rank {a.rank} is not the owner of chunk {a.chunk}")
        if a.chunk in self.owner_steps:
            raise ScheduleError(f"{a}: gradient arrives after the optimizer step of chunk {a.chunk}")
        self.owner_acc[a.chunk].update(got.parts)
        st.buffers[a.buffer] = None

    def _on_optimizer_step(self, a: Action, matched: Optional[Action]) -> None:
        if a.rank != a.chunk:
            raise ScheduleError(f"{a}: rank {a.rank} steps chunk {a.chunk}, which it does not own")
        if a.chunk in self.owner_steps:
            raise ScheduleError(f"{a}: second optimizer step of chunk {a.chunk}")
        want = Counter({(r, m): 1 for r in range(self.P) for m in range(self.G)})
        have = self.owner_acc[a.chunk]
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = sorted(key for key, n in have.items() if n > want.get(key, 0))
            raise ScheduleError(
                f"{a}: chunk {a.chunk}'s gradient is incomplete at its owner: missing (rank, mb) "
                f"{missing[:6]}{'...' if len(missing) > 6 else ''}, counted more than once {extra[:6]}"
            )
        self.owner_steps.add(a.chunk)

    # ------------------------------------------------------------------ the end

    def finish(self) -> None:
        for c in range(self.schedule.num_chunks):
            if c not in self.owner_steps:
                raise ScheduleError(f"chunk {c} never reaches its optimizer step on rank {c}")
        want = {(m, c) for m in range(self.G) for c in range(self.schedule.num_chunks)}
        for st in self.states:
            for name, done in (("forward", st.forward_done), ("input gradient", st.input_grad_done),
                               ("weight gradient", st.weight_grad_done)):
                if done != want:
                    missing = sorted(want - done)
                    raise ScheduleError(f"rank {st.rank} never runs the {name} of (mb, chunk) {missing[:6]}")
            if len(st.loss_done) != self.G:
                raise ScheduleError(f"rank {st.rank} computes {len(st.loss_done)} losses, expected {self.G}")
            live = {str(b): str(c) for b, c in st.buffers.items() if c is not None}
            if live:
                raise ScheduleError(f"rank {st.rank} ends with live buffers {live}")


class _ActivationChecker:
    """Megatron timelines: each stage's input (activation or its gradient) arrives from
    the neighbouring stage for the same microbatch before the compute that needs it.
    Per rank, a set of what has happened: (flow, mb, stage) for arrivals and
    ("F" | "B" | "W", mb, stage) for the computes run."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.S = schedule.num_chunks
        self.have: list[set] = [set() for _ in range(schedule.num_ranks)]
        self.handlers: dict[Kind, Visit] = {
            Kind.RECV: self._on_recv,
            Kind.FORWARD: self._on_forward,
            Kind.BACKWARD: self._on_backward,
            Kind.BACKWARD_INPUT: self._on_backward,
            Kind.BACKWARD_WEIGHT: self._on_backward_weight,
        }

    def visit(self, a: Action, matched: Optional[Action]) -> None:
        handler = self.handlers.get(a.kind)
        if handler is not None:
            handler(a, matched)

    def _on_recv(self, a: Action, matched: Optional[Action]) -> None:
        step = 1 if a.flow is Flow.ACTIVATIONS else -1
        if matched.flow is not a.flow or matched.mb != a.mb or matched.chunk + step != a.chunk:
            raise ScheduleError(f"{a}: paired with {matched}")
        self.have[a.rank].add((a.flow, a.mb, a.chunk))

    def _on_forward(self, a: Action, matched: Optional[Action]) -> None:
        got = self.have[a.rank]
        if a.chunk > 0 and (Flow.ACTIVATIONS, a.mb, a.chunk) not in got and ("F", a.mb, a.chunk - 1) not in got:
            raise ScheduleError(f"{a}: its input activation has not arrived")
        got.add(("F", a.mb, a.chunk))

    def _on_backward(self, a: Action, matched: Optional[Action]) -> None:
        got = self.have[a.rank]
        if ("F", a.mb, a.chunk) not in got:
            raise ScheduleError(f"{a}: backward before its forward")
        if a.chunk < self.S - 1 and (Flow.ACTIVATION_GRADS, a.mb, a.chunk) not in got:
            raise ScheduleError(f"{a}: its output gradient has not arrived")
        if ("B", a.mb, a.chunk) in got:
            raise ScheduleError(f"{a}: second backward of that microbatch")
        got.add(("B", a.mb, a.chunk))
        if a.kind is Kind.BACKWARD:
            got.add(("W", a.mb, a.chunk))

    def _on_backward_weight(self, a: Action, matched: Optional[Action]) -> None:
        """A split backward's weight gradient (zb-h1)."""
        got = self.have[a.rank]
        if ("B", a.mb, a.chunk) not in got:
            raise ScheduleError(f"{a}: weight gradient before the input-gradient pass")
        if ("W", a.mb, a.chunk) in got:
            raise ScheduleError(f"{a}: weight gradient computed twice")
        got.add(("W", a.mb, a.chunk))

    def finish(self) -> None:
        P = self.schedule.num_ranks
        for r, got in enumerate(self.have):
            for m in range(self.schedule.microbatches):
                for c in range(r, self.S, P):
                    for step, name in (("F", "forward"), ("B", "backward"), ("W", "weight gradient")):
                        if (step, m, c) not in got:
                            raise ScheduleError(f"rank {r} never runs the {name} of microbatch {m} at stage {c}")
