"""Where FPDT keeps per-chunk state between the forward and the backward.

``ChunkStore`` is the state of one forward/backward pair. Tensors are grouped into named
streams (e.g. "kv" holds k and v of each chunk); ``put`` records a chunk's tensors,
``prefetch`` starts bringing a chunk to the device, ``get`` returns it there, ``release``
drops the device copy. With offload, the host copies live in buffers of a
``HostBufferPool`` (fpdt/host_pool.py: shared by a model's attention layers, pinned on
CUDA, carved out of power-of-two slabs) and every copy goes through the pool's copy
service (fpdt/copy_streams.py: on CUDA device->host on one side stream and host->device on
another, ordered by events, no device synchronize or barrier per chunk; on a CPU host
plain copies, so tests exercise the same code). A buffer goes back to the pool only after
its last use (``drop`` / ``close``). With offload off the tensors simply stay where they are.

The store counts, per stream, how many chunks are resident on the device through it
(working + prefetched) and refuses to exceed ``max_resident`` (2: double buffering).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from megatron_weipipe.fpdt.host_pool import HostBufferPool


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


class ChunkStore:
    def __init__(
        self,
        device,
        offload: bool,
        pool: HostBufferPool | None = None,
        max_resident: int = 2,
        stats: OffloadStats | None = None,
        role: str = "fpdt_chunk_state",
        copy_streams=None,
    ):
        self.device = torch.device(device)
        self.role = role  # what its device copies are, for memory accounting (tools/dry_run.py)
        self.offload = offload
        cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else HostBufferPool(pin_memory=cuda and offload)
        # the copy service (fpdt/copy_streams.py): the pool's, shared by every store over it
        self.copies = copy_streams if copy_streams is not None else (
            self.pool.copy_streams(self.device) if offload else None)
        self.max_resident = max_resident
        self.stats = stats if stats is not None else OffloadStats()
        self._held: dict = defaultdict(dict)  # (stream, idx) -> {name: tensor (host buf, or device if no offload)}
        self._dev: dict = {}  # (stream, idx) -> {name: device tensor}, offload mode only
        self._pending: dict = {}  # (stream, idx) -> what copies.ready needs before the first use
        self._resident: dict = defaultdict(set)  # stream -> idx with device copies

    # -- writing -------------------------------------------------------------------
    def put(self, stream: str, idx: int, **tensors: torch.Tensor) -> None:
        """Record (or overwrite) tensors of chunk ``idx``. With offload the device tensor
        may be freed by the caller right after (the copy service keeps it alive)."""
        held = self._held[(stream, idx)]
        if not self.offload:
            self._count(sum(_nbytes(t) for t in tensors.values()) - sum(_nbytes(held[n]) for n in tensors if n in held))
            held.update(tensors)
            return
        for name, t in tensors.items():
            buf = held.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                if buf is not None:
                    self.pool.give(buf)
                buf = self.pool.take(t.shape, t.dtype)
                held[name] = buf
            self.copies.to_host(buf, t, self.pool.fence(buf))
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
        dev, marker = {}, None
        for n, b in held.items():
            dev[n], marker = self.copies.to_device(b, self.device, self.pool.fence(b))
        self._pending[(stream, idx)] = marker
        self.stats.h2d_bytes += sum(_nbytes(b) for b in held.values())
        self.stats.fetches += 1
        self._count(sum(_nbytes(t) for t in dev.values()))
        self._dev[(stream, idx)] = dev

    def get(self, stream: str, idx: int) -> dict:
        """Device tensors of chunk ``idx`` (the compute stream waits for its prefetch)."""
        if not self.offload:
            return dict(self._held[(stream, idx)])
        self.prefetch(stream, idx)
        if (stream, idx) in self._pending:
            self.copies.ready(self._dev[(stream, idx)].values(), self._pending.pop((stream, idx)))
        return dict(self._dev[(stream, idx)])

    def release(self, stream: str, idx: int) -> None:
        """Drop the device copy of chunk ``idx`` (host copy stays)."""
        if not self.offload:
            return
        dev = self._dev.pop((stream, idx), None)
        if dev is not None:
            self._count(-sum(_nbytes(t) for t in dev.values()))
        self._pending.pop((stream, idx), None)
        self._resident[stream].discard(idx)

    def drop(self, stream: str, idx: int) -> None:
        """Forget chunk ``idx`` entirely (its host buffers go back to the pool; their fences
        keep whoever takes them next from overwriting a buffer a queued copy still reads)."""
        self.release(stream, idx)
        for buf in self._held.pop((stream, idx), {}).values():
            if self.offload:
                self.pool.give(buf)
            else:
                self._count(-_nbytes(buf))

    def close(self) -> None:
        """End of the backward: the compute stream waits for every copy, and every host
        buffer goes back to the pool for the next call."""
        if self.offload:
            self.copies.drain()
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
