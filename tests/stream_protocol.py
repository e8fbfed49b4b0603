"""CUDA streams and events on a CPU host: logging fakes and a checker of what they order.

On a GPU a copy on a side stream runs whenever its stream gets to it: only events,
``wait_stream`` / ``wait_event`` and ``record_stream`` keep a copy from reading a tensor
before it is written, a buffer from being overwritten while a copy still reads it, or
the caching allocator from handing a tensor's memory to someone else while another
stream still uses it. On a CPU host every op runs at once, in program order, so none of
these mistakes shows. ``StreamWorld`` replaces ``torch.cuda.Stream`` / ``Event`` /
``current_stream`` / ``stream`` / ``synchronize`` and ``Tensor.record_stream`` with fakes
that keep a vector clock per stream, and logs every aten op (``TorchDispatchMode``) with
the stream it was issued on and the byte ranges it read and wrote. The rules are checked
over that log as it grows, so they stay true whatever the code under test does:

- ordering: two accesses of overlapping bytes on different streams, at least one a
  write, must be ordered (the later one's stream has waited, through events or
  ``wait_stream``, for the earlier one);
- lifetime: a device tensor used on a stream other than the one it was allocated on
  must be ``record_stream``'ed there (or that use be ordered before its allocation
  stream's work) by the time its memory is freed; host buffers (marked with
  ``residency.host_buffer``) are not the device allocator's and must not be
  ``record_stream``'ed (a GPU raises);
- direction: no stream carries both device->host copies (host storage written from
  device data) and host->device ones (host storage read into a device tensor);
- drain: at ``check_drained``, the compute stream has waited for every side-stream op;
- no host synchronization (``Event.synchronize`` / ``query``, ``Stream.synchronize``,
  ``torch.cuda.synchronize``).

While installed, a store whose device is "cuda" runs on CPU tensors: ``Tensor.to("cuda")``
makes a fresh CPU copy (as a real device copy is a new tensor) and the op logger (a
dispatch mode, active in autograd's backward too) drops ``pin_memory``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_weipipe import residency

_PKG = os.sep + "megatron_weipipe" + os.sep
_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _site() -> str:
    """The innermost project frame (file:line in function), for messages."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if _PKG in path:
            return f"{path.split(_PKG, 1)[1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<test>"


class FakeEvent:
    def __init__(self, world: "StreamWorld", *args, **kwargs):
        self.world, self.vc = world, None

    def record(self, stream=None):
        stream = stream if stream is not None else self.world.current()
        self.vc = dict(self.world.vc[stream])
        self.world.log.append(("record", stream.name, _site()))

    def wait(self, stream=None):
        (stream if stream is not None else self.world.current()).wait_event(self)

    def synchronize(self):
        self.world.host_sync("Event.synchronize")

    def query(self):
        self.world.host_sync("Event.query")
        return True


class FakeStream:
    def __init__(self, world: "StreamWorld", name: str):
        self.world, self.name = world, name
        world.vc[self] = {self: 0}

    def wait_stream(self, other):
        self.world.join(self, self.world.vc[other], f"wait_stream({other.name})")

    def wait_event(self, event):
        if event.vc is not None:
            self.world.join(self, event.vc, "wait_event")

    def record_event(self, event=None):
        event = event if event is not None else FakeEvent(self.world)
        event.record(self)
        return event

    def synchronize(self):
        self.world.host_sync("Stream.synchronize")

    def query(self):
        self.world.host_sync("Stream.query")
        return True

    def __repr__(self):
        return f"<stream {self.name}>"


@dataclass
class _Access:
    lo: int
    hi: int
    stream: FakeStream
    seq: int
    write: bool
    site: str


@dataclass
class _Storage:
    alloc: FakeStream
    host: bool = False
    recorded: set = field(default_factory=set)
    accesses: list = field(default_factory=list)
    ref: object = None


class StreamWorld:
    """The fakes' shared state: streams' vector clocks, storages, accesses, violations."""

    def __init__(self):
        self.vc: dict = {}
        self.compute = FakeStream(self, "compute")
        self._stack = [self.compute]
        self._sides = 0
        self.storages: dict[int, _Storage] = {}
        self.violations: list[str] = []
        self.directions: dict = {}  # stream name -> {"d2h", "h2d"}
        self.copies = {"d2h": 0, "h2d": 0}
        self.log: list = []

    # -- the fakes -----------------------------------------------------------------
    def current(self, device=None) -> FakeStream:
        return self._stack[-1]

    def new_stream(self, *args, **kwargs) -> FakeStream:
        self._sides += 1
        return FakeStream(self, f"side{self._sides}")

    @contextlib.contextmanager
    def use(self, stream):
        if stream is None:
            yield
            return
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def join(self, stream: FakeStream, clock: dict, what: str) -> None:
        vc = self.vc[stream]
        for s, n in clock.items():
            vc[s] = max(vc.get(s, 0), n)
        self.log.append((what, stream.name, _site()))

    def host_sync(self, what: str) -> None:
        self.violations.append(f"host synchronization {what} at {_site()}")

    def record_stream(self, t: torch.Tensor, stream) -> None:
        info = self._storage(t, fresh=False)
        if info.host:
            self.violations.append(f"record_stream on a host buffer at {_site()} (a GPU raises)")
        info.recorded.add(stream)
        self.log.append(("record_stream", stream.name, _site()))

    def mark_host(self, t: torch.Tensor) -> None:
        self._storage(t, fresh=True).host = True

    @contextlib.contextmanager
    def installed(self):
        """Patch torch.cuda's streams/events and Tensor.record_stream; log aten ops."""
        cuda, saved = torch.cuda, {}
        fakes = {
            "Stream": self.new_stream, "Event": lambda *a, **k: FakeEvent(self), "current_stream": self.current,
            "default_stream": lambda *a, **k: self.compute, "stream": self.use,
            "synchronize": lambda *a, **k: self.host_sync("torch.cuda.synchronize"),
            "current_device": lambda: 0,
        }
        for name, fake in fakes.items():
            saved[name] = getattr(cuda, name)
            setattr(cuda, name, fake)
        record, to = torch.Tensor.record_stream, torch.Tensor.to
        torch.Tensor.record_stream = lambda t, s: self.record_stream(t, s)
        torch.Tensor.to = _to_cpu_for_cuda(to)
        try:
            with residency.observing(self.mark_host), _Logger(self):
                yield self
        finally:
            torch.Tensor.record_stream, torch.Tensor.to = record, to
            for name, fn in saved.items():
                setattr(cuda, name, fn)

    # -- the log -------------------------------------------------------------------
    def _storage(self, t: torch.Tensor, fresh: bool) -> _Storage:
        st = t.untyped_storage()
        key = id(st)
        info = self.storages.get(key)
        if info is None or info.ref() is not st:
            # first sight: made by this op on the current stream, or before the run (compute)
            info = _Storage(alloc=self.current() if fresh else self.compute)
            info.ref = weakref.ref(st, lambda _r, k=key: self._freed(k))
            self.storages[key] = info
        return info

    def access(self, t: torch.Tensor, write: bool, fresh: bool = False) -> None:
        if t.numel() == 0:
            return
        info = self._storage(t, fresh)
        stream = self.current()
        es = t.element_size()
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        lo = t.storage_offset() * es
        new = _Access(lo, lo + span * es, stream, self.vc[stream][stream], write, _site())
        vc = self.vc[stream]
        for old in info.accesses:
            if old.stream is stream or not (write or old.write) or old.hi <= new.lo or new.hi <= old.lo:
                continue
            if vc.get(old.stream, 0) < old.seq:
                kind = "host buffer" if info.host else "device tensor"
                self.violations.append(
                    f"unordered {'write' if write else 'read'} of a {kind} on {stream.name} at {new.site} after "
                    f"{'write' if old.write else 'read'} on {old.stream.name} at {old.site}")
        info.accesses.append(new)

    def op(self, reads, writes, fresh) -> None:
        stream = self.current()
        self.vc[stream][stream] += 1
        for t in reads:
            self.access(t, write=False)
        for t in writes:
            self.access(t, write=True)
        for t in fresh:
            self.access(t, write=True, fresh=True)
        if stream is not self.compute:
            host_written = any(self._storage(t, False).host for t in writes)
            host_read = any(self._storage(t, False).host for t in reads)
            kind = "d2h" if host_written else "h2d" if host_read and fresh else None
            if kind is not None:
                self.copies[kind] += 1
                self.directions.setdefault(stream.name, set()).add(kind)

    def _freed(self, key: int) -> None:
        info = self.storages.pop(key, None)
        if info is None or info.host:
            return
        vc = self.vc[info.alloc]
        for a in info.accesses:
            if a.stream is not info.alloc and a.stream not in info.recorded and vc.get(a.stream, 0) < a.seq:
                self.violations.append(
                    f"device tensor allocated on {info.alloc.name} freed while its use on {a.stream.name} at "
                    f"{a.site} may be queued (no record_stream({a.stream.name}))")
                return

    # -- rules checked at the end ----------------------------------------------------
    def check_drained(self) -> None:
        vc = self.vc[self.compute]
        for s, clock in self.vc.items():
            if s is not self.compute and vc.get(s, 0) < clock[s]:
                self.violations.append(f"{clock[s] - vc.get(s, 0)} ops on {s.name} not waited for by the compute stream")

    def check_directions(self) -> None:
        for name, kinds in self.directions.items():
            if len(kinds) > 1:
                self.violations.append(f"stream {name} carries both device->host and host->device copies")


class _Logger(TorchDispatchMode):
    """Every aten op: its tensor reads, in-place writes and fresh outputs, on the current stream."""

    def __init__(self, world: StreamWorld):
        super().__init__()
        self.world = world

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):  # no pinned allocator on a CPU host
            kwargs["pin_memory"] = False
        out = func(*args, **kwargs)
        schema = func._schema
        reads, writes = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            (writes if is_write else reads).extend(tensors)
        inputs = {t.untyped_storage().data_ptr() for t in reads + writes if t.numel()}
        results = out if isinstance(out, (list, tuple)) else [out]
        outs = [t for t in results if isinstance(t, torch.Tensor)]
        if not writes and outs and all(t.untyped_storage().data_ptr() in inputs for t in outs):
            return out  # a view (slice, view, permute, detach, ...): no data touched
        fresh = []
        if func.__name__.split(".")[0] not in _EMPTY:
            fresh = [t for t in results if isinstance(t, torch.Tensor) and t.numel()
                     and t.untyped_storage().data_ptr() not in inputs]
        else:
            for t in results:
                if isinstance(t, torch.Tensor):
                    self.world._storage(t, fresh=True)
        self.world.op(reads, writes, fresh)
        return out


def _is_cuda(device) -> bool:
    return (isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, str) and device.startswith("cuda"))


def _to_cpu_for_cuda(to):
    """``Tensor.to`` that makes a fresh CPU copy where it is asked for a CUDA device."""

    def patched(t, *args, **kwargs):
        if args and _is_cuda(args[0]):
            return to(t, "cpu", *args[1:], **dict(kwargs, copy=True))
        if _is_cuda(kwargs.get("device")):
            return to(t, *args, **dict(kwargs, device="cpu", copy=True))
        return to(t, *args, **kwargs)

    return patched
