"""Where FPDT keeps per-chunk state between the forward and the backward.

``HostBufferPool`` owns host buffers (pinned on CUDA). The model shares one among all
its attention layers (model/long_context.py). Buffers are allocated the first time a
(shape, dtype) is needed with none free, and a ``ChunkStore`` hands each back only after
its last use (``drop`` / ``close``), so later layers, iterations and micro-batches reuse
them: the pool grows to the most buffers live at once. Every host copy into or out of a
pool's buffers runs on the pool's one side stream, so a buffer given back while a copy
from it is still queued is only overwritten after that copy (stream order); sharing the
stream across layers puts all their copies, both directions, in one queue (a layer's
own already were) but keeps them overlapping compute.

``ChunkStore`` is the state of one forward/backward pair. Tensors are grouped into named
streams (e.g. "kv" holds k and v of each chunk); ``put`` records a chunk's tensors,
``prefetch`` starts bringing a chunk to the device, ``get`` returns it there, ``release``
drops the device copy. With offload on, device -> host copies and host -> device
prefetches run on one side CUDA stream, so copies overlap compute and stay ordered among
themselves; no device synchronize or barrier is issued per chunk. On CPU the same code
runs with plain copies ("device" is the CPU) so tests exercise it. With offload off the
tensors simply stay where they are.

The store counts, per stream, how many chunks are resident on the device through it
(working + prefetched) and refuses to exceed ``max_resident`` (2: double buffering).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from megatron_weipipe.residency import host_buffer


@dataclass
class OffloadStats:
    """Counts for tests and benchmarks."""

    max_resident: dict = field(default_factory=dict)  # stream -> most chunks resident at once
    device_bytes: int = 0  # bytes of chunk state the store holds on the device now
    peak_device_bytes: int = 0  # ... and at most (all saved state when offload is off)
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    fetches: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostBufferPool:
    """Reusable host buffers keyed by (shape, dtype)."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._free: dict = defaultdict(list)
        self._streams: dict = {}
        self.allocations = 0
        self.allocated_bytes = 0

    def side_stream(self, device: torch.device):
        """The one copy stream of this pool on ``device`` (created once)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def take(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if self._free[key]:
            return self._free[key].pop()
        self.allocations += 1
        buf = host_buffer(torch.empty(key[0], dtype=dtype, device="cpu", pin_memory=self.pin_memory))
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[(tuple(buf.shape), buf.dtype)].append(buf)


class ChunkStore:
    def __init__(
        self,
        device,
        offload: bool,
        pool: HostBufferPool | None = None,
        max_resident: int = 2,
        stats: OffloadStats | None = None,
        role: str = "fpdt_chunk_state",
    ):
        self.device = torch.device(device)
        self.role = role  # what its device copies are, for memory accounting (tools/dry_run.py)
        self.offload = offload
        self.cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else HostBufferPool(pin_memory=self.cuda and offload)
        self.max_resident = max_resident
        self.stats = stats if stats is not None else OffloadStats()
        self._held: dict = defaultdict(dict)  # (stream, idx) -> {name: tensor (host buf, or device if no offload)}
        self._dev: dict = {}  # (stream, idx) -> {name: device tensor}, offload mode only
        self._events: dict = {}  # (stream, idx) -> CUDA event of a pending prefetch
        self._resident: dict = defaultdict(set)  # stream -> idx with device copies
        self._side = self.pool.side_stream(self.device) if (self.cuda and offload) else None

    # -- writing -------------------------------------------------------------------
    def put(self, stream: str, idx: int, **tensors: torch.Tensor) -> None:
        """Record (or overwrite) tensors of chunk ``idx``. With offload the device tensor
        may be freed by the caller right after; its copy completes on the side stream."""
        held = self._held[(stream, idx)]
        if not self.offload:
            self._count(sum(_nbytes(t) for t in tensors.values()) - sum(_nbytes(held[n]) for n in tensors if n in held))
            held.update(tensors)
            return
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        for name, t in tensors.items():
            buf = held.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                if buf is not None:
                    self.pool.give(buf)
                buf = self.pool.take(t.shape, t.dtype)
                held[name] = buf
            if self._side is not None:
                with torch.cuda.stream(self._side):
                    buf.copy_(t, non_blocking=True)
                t.record_stream(self._side)
            else:
                buf.copy_(t)
            self.stats.d2h_bytes += t.numel() * t.element_size()
        # A device copy of this chunk (if any) is now stale for the names written.
        dev = self._dev.get((stream, idx))
        if dev is not None:
            for name, t in tensors.items():
                self._count(_nbytes(t) - (_nbytes(dev[name]) if name in dev else 0))
                dev[name] = t

    def has(self, stream: str, idx: int, name: str) -> bool:
        return name in self._held.get((stream, idx), {})

    # -- reading -------------------------------------------------------------------
    def prefetch(self, stream: str, idx: int) -> None:
        """Start the host -> device copy of chunk ``idx`` (no-op without offload)."""
        if not self.offload or (stream, idx) in self._dev:
            return
        self._mark_resident(stream, idx)
        held = self._held[(stream, idx)]
        if self._side is not None:
            with torch.cuda.stream(self._side):
                dev = {n: b.to(self.device, non_blocking=True) for n, b in held.items()}
                ev = torch.cuda.Event()
                ev.record(self._side)
            self._events[(stream, idx)] = ev
        else:
            dev = {n: b.clone() for n, b in held.items()}
        self.stats.h2d_bytes += sum(_nbytes(b) for b in held.values())
        self.stats.fetches += 1
        self._count(sum(_nbytes(t) for t in dev.values()))
        self._dev[(stream, idx)] = dev

    def get(self, stream: str, idx: int) -> dict:
        """Device tensors of chunk ``idx`` (waits for its prefetch)."""
        if not self.offload:
            return dict(self._held[(stream, idx)])
        self.prefetch(stream, idx)
        ev = self._events.pop((stream, idx), None)
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for t in self._dev[(stream, idx)].values():
                t.record_stream(cur)
        return dict(self._dev[(stream, idx)])

    def release(self, stream: str, idx: int) -> None:
        """Drop the device copy of chunk ``idx`` (host copy stays)."""
        if not self.offload:
            return
        dev = self._dev.pop((stream, idx), None)
        if dev is not None:
            self._count(-sum(_nbytes(t) for t in dev.values()))
        self._events.pop((stream, idx), None)
        self._resident[stream].discard(idx)

    def drop(self, stream: str, idx: int) -> None:
        """Forget chunk ``idx`` entirely (its host buffers go back to the pool)."""
        self.release(stream, idx)
        for buf in self._held.pop((stream, idx), {}).values():
            if self.offload:
                self.pool.give(buf)
            else:
                self._count(-_nbytes(buf))

    def close(self) -> None:
        """End of the backward: return every host buffer to the pool for the next call."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        for stream, idx in list(self._held):
            self.drop(stream, idx)

    def _count(self, delta: int) -> None:
        self.stats.device_bytes += delta
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes)

    def resident(self, stream: str) -> int:
        return len(self._resident[stream])

    def _mark_resident(self, stream: str, idx: int) -> None:
        res = self._resident[stream]
        res.add(idx)
        if len(res) > self.max_resident:
            raise RuntimeError(
                f"offload stream {stream!r} would hold {len(res)} chunks on the device "
                f"(limit {self.max_resident}): chunks {sorted(res)}"
            )
        self.stats.max_resident[stream] = max(self.stats.max_resident.get(stream, 0), len(res))
