"""Host buffers for offloaded state, carved out of power-of-two slabs.

``HostBufferPool`` owns host buffers (pinned on CUDA). The model shares one among all its
attention layers (model/long_context.py); whole-model activation offload has its own
(model/layer_offload.py). A buffer is made the first time a (shape, dtype) is needed with
none free and comes back with ``give`` after its last use, so later layers, iterations and
micro-batches reuse it: the pool grows to the most buffers live at once and never shrinks.

Buffers are views into slabs: torch's pinned allocator rounds each request up to a power
of two, so a pool allocating buffer by buffer would pin up to twice what it asked for.
The pool asks only for power-of-two slabs (``residency.slab_layout``: the one home of the
rule) and carves buffers of one byte size out of them; ``allocated_bytes`` (the slabs,
what the host really gives) is what the dry run counts and the simulator estimates
(``residency.pool_bytes``), ``buffer_bytes`` what the buffers themselves hold.

Each buffer has a ``Fence``: the events of its last device->host write and last
host->device read (``copy_streams``), kept with the buffer when it goes back to the pool,
so whoever takes it next cannot overwrite it while a copy from it is still queued.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_weipipe.residency import buffer_stride, host_buffer, slab_layout


@dataclass
class Fence:
    """The last copies that touched one host buffer (CUDA events; None: none pending)."""

    written: Any = None  # device -> host copy into it
    read: Any = None  # host -> device copy out of it


class _Slabs:
    """Slabs of one buffer size, filled in order."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.slab_bytes, self.per_slab = slab_layout(nbytes)
        self.stride = buffer_stride(nbytes)
        self.current: Optional[torch.Tensor] = None
        self.used = 0  # buffers carved from ``current``


class HostBufferPool:
    """Reusable host buffers keyed by (shape, dtype), carved out of power-of-two slabs.

    ``copy_streams``: the copy service every ``ChunkStore`` over this pool uses (one per
    pool, so all layers' copies share its streams); None: made on first use for the
    store's device (``copy_streams.for_device``)."""

    def __init__(self, pin_memory: bool = False, copy_streams=None):
        self.pin_memory = pin_memory
        self._free: dict = defaultdict(list)
        self._fences: dict = {}  # id(buffer) -> (buffer, Fence): every buffer this pool made
        self._slabs: dict = {}  # buffer bytes -> _Slabs
        self._copy_streams = copy_streams
        self.allocations = 0  # buffers made
        self.buffer_bytes = 0  # ... and their bytes (what was asked for)
        self.slabs = 0  # slabs allocated
        self.allocated_bytes = 0  # ... and their bytes: the host memory this pool holds

    def copy_streams(self, device: torch.device):
        """The pool's copy service (``copy_streams.CopyStreams``), made once."""
        if self._copy_streams is None:
            from megatron_weipipe.fpdt.copy_streams import for_device

            self._copy_streams = for_device(device)
        return self._copy_streams

    def take(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if self._free[key]:
            return self._free[key].pop()
        numel = 1
        for n in key[0]:
            numel *= n
        nbytes = numel * dtype.itemsize
        buf = self._carve(nbytes).view(dtype).view(key[0]) if nbytes else torch.empty(key[0], dtype=dtype)
        self.allocations += 1
        self.buffer_bytes += nbytes
        self._fences[id(buf)] = (buf, Fence())
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[(tuple(buf.shape), buf.dtype)].append(buf)

    def fence(self, buf: torch.Tensor) -> Fence:
        """The pending copies of ``buf`` (a buffer this pool made)."""
        entry = self._fences.get(id(buf))
        if entry is None or entry[0] is not buf:
            raise KeyError("not a buffer of this pool")
        return entry[1]

    def _carve(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (uint8) at the next free place of its size's slabs."""
        s = self._slabs.get(nbytes)
        if s is None:
            s = self._slabs[nbytes] = _Slabs(nbytes)
        if s.current is None or s.used == s.per_slab:
            s.current = host_buffer(torch.empty(s.slab_bytes, dtype=torch.uint8, device="cpu",
                                                pin_memory=self.pin_memory))
            s.used = 0
            self.slabs += 1
            self.allocated_bytes += s.slab_bytes
        start = s.used * s.stride
        s.used += 1
        return s.current[start:start + nbytes]
