"""Bytes and messages sent and received by this rank, by kind.

Counts are exact and machine-independent (unlike times), so benchmarks and tests can
compare schedules by them. One class serves two uses: the process-wide counter
(``process_byte_counter``) wraps torch.distributed's calls once at start-up and attributes
point-to-point traffic to the innermost active ``scope`` (e.g. "activations" inside
Megatron's pipeline schedules, or a WeiPipe flow), collectives as "collectives" with the
tensor's size per call (the payload handed to the collective, not the algorithm's wire
traffic; nothing for a group of one rank, which sends nothing: megatron-core's cross
entropy all-reduces over the tensor-parallel group even at TP = 1); a runtime may also
keep its own instance and ``count`` what it sends.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist


_UNCOUNTED = "<uncounted>"


class ByteCounter:
    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.messages_sent: dict[str, int] = defaultdict(int)
        self.messages_received: dict[str, int] = defaultdict(int)
        self._scopes = threading.local()
        self._installed = False
        self._group_kinds: dict[str, tuple] = {}  # group name -> (kind, wire bytes of a payload)

    # -- attribution ------------------------------------------------------------------
    def _kind(self, default: str) -> str:
        stack = getattr(self._scopes, "stack", None)
        return stack[-1] if stack else default

    @contextlib.contextmanager
    def scope(self, kind: str):
        stack = getattr(self._scopes, "stack", None)
        if stack is None:
            stack = self._scopes.stack = []
        stack.append(kind)
        try:
            yield
        finally:
            stack.pop()

    def uncounted(self):
        """A scope whose calls the hooks leave out: traffic already counted by its issuer
        (FSDP counts its own collectives, whichever torch.distributed call runs them)."""
        return self.scope(_UNCOUNTED)

    def count_group_as(self, group, kind: str, wire_bytes) -> None:
        """Count the collectives on ``group`` as ``kind``, ``wire_bytes(payload, group size)``
        each: traffic a library issues through torch.distributed on a group of its own
        (HSDP's all-reduce across replicas). Keyed by the group's name, so a destroyed
        group is not kept alive."""
        self._group_kinds[group.group_name] = (kind, wire_bytes)

    def add_sent(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += int(nbytes)
        self.messages_sent[kind] += 1

    def add_received(self, kind: str, nbytes: int) -> None:
        self.received[kind] += int(nbytes)
        self.messages_received[kind] += 1

    def count(self, kind: str, nbytes: int, *, sent: bool) -> None:
        (self.add_sent if sent else self.add_received)(kind, nbytes)

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def reset(self) -> None:
        for d in (self.sent, self.received, self.messages_sent, self.messages_received):
            d.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"sent": dict(self.sent), "received": dict(self.received)}

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"sent": dict(self.sent), "received": dict(self.received),
                "messages_sent": dict(self.messages_sent), "messages_received": dict(self.messages_received)}

    # -- hooks ------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap torch.distributed's p2p and collective calls. Idempotent."""
        if self._installed:
            return
        self._installed = True
        for name, sending in (("isend", True), ("send", True), ("irecv", False), ("recv", False)):
            setattr(dist, name, self._wrap_p2p(getattr(dist, name), sending))
        dist.batch_isend_irecv = self._wrap_batch_p2p(dist.batch_isend_irecv)
        for name, arg_index in _COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap_collective(getattr(dist, name), arg_index))
        self._wrap_megatron_buffer_calls()

    def _wrap_p2p(self, fn, sending: bool):
        counter = self

        @functools.wraps(fn)
        def inner(tensor, *args, **kwargs):
            kind = counter._kind("p2p")
            if kind != _UNCOUNTED:
                (counter.add_sent if sending else counter.add_received)(kind, _nbytes(tensor))
            return fn(tensor, *args, **kwargs)

        return inner

    def _wrap_batch_p2p(self, original_batch):
        counter = self

        @functools.wraps(original_batch)
        def batch_isend_irecv(ops):
            kind = counter._kind("p2p")
            for op in ops if kind != _UNCOUNTED else ():
                sending = getattr(op.op, "__name__", "") in ("isend", "send")
                (counter.add_sent if sending else counter.add_received)(kind, _nbytes(op.tensor))
            return original_batch(ops)

        return batch_isend_irecv

    def _wrap_collective(self, fn, arg_index=0):
        counter = self
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            kind = counter._kind("collectives")
            kind = kind if kind != "activations" else "collectives"
            if kind == _UNCOUNTED or _group_of_one(signature, args, kwargs):  # the cheap test first
                return fn(*args, **kwargs)
            t = args[arg_index] if len(args) > arg_index else next(iter(kwargs.values()), None)
            size = sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else _nbytes(t)
            attributed = counter._group_kinds and counter._attributed(signature, args, kwargs)
            if attributed:
                (kind, wire), group = attributed
                size = wire(size, dist.get_world_size(group))
            counter.add_sent(kind, size)
            counter.add_received(kind, size)
            return fn(*args, **kwargs)

        inner._counted = True
        return inner

    def _attributed(self, signature, args, kwargs):
        """((kind, wire bytes), group) when the call's group is one of count_group_as's."""
        group = _group_arg(signature, args, kwargs)
        entry = self._group_kinds.get(group.group_name) if group is not None else None
        return (entry, group) if entry is not None else None

    def _wrap_megatron_buffer_calls(self) -> None:
        """megatron-core binds its distributed optimizer's reduce-scatter and all-gather at
        import, past the wrappers of torch.distributed (counted here unless already wrapped)."""
        try:
            from megatron.core.distributed import param_and_grad_buffer as pgb
        except ImportError:
            return
        for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
            fn = getattr(pgb, name, None)
            if fn is not None and not getattr(fn, "_counted", False):
                setattr(pgb, name, self._wrap_collective(fn, 1))


# torch.distributed's collectives, with the position of the tensor whose size is counted
_COLLECTIVES = (
    ("all_reduce", 0), ("broadcast", 0), ("all_gather_into_tensor", 1), ("reduce_scatter_tensor", 1),
    ("all_to_all_single", 1), ("reduce", 0), ("all_gather", 1), ("reduce_scatter", 1),
)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_arg(signature, args, kwargs):
    """The ``group`` a collective call names (None: the default group)."""
    group = kwargs.get("group")
    if group is None and signature is not None:
        try:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            return None
    return group


def _group_of_one(signature, args, kwargs) -> bool:
    """Whether a collective call's group has one rank (it sends nothing)."""
    return dist.is_initialized() and dist.get_world_size(_group_arg(signature, args, kwargs)) == 1


_PROCESS_COUNTER = ByteCounter()


def process_byte_counter() -> ByteCounter:
    """The counter of this process's torch.distributed traffic, hooks installed.

    torch.distributed's functions are process-wide, so there is one such counter per
    process; start-up fetches it here and passes it to whatever reports bytes.
    """
    _PROCESS_COUNTER.install()
    return _PROCESS_COUNTER
