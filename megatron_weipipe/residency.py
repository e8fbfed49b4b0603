"""Which tensors live in host memory on purpose, and how many bytes they really take.

On a CPU host every tensor is a "cpu" tensor, so the device type cannot tell an offloaded
buffer from an activation. Offload code therefore names its host buffers: every
allocation that is meant to stay in host memory while the accelerator works (FPDT's
``HostBufferPool``, whole-layer activation offload, ...) passes through ``host_buffer``
right after it is made. Observers (``tools/dry_run.py`` counts such storages as host
bytes, not accelerator bytes) register with ``observing``; with none registered the call
costs one list check. Only the first call per storage matters; a view of a marked buffer
shares its storage and needs no mark.

The second half is the one home of the host allocation rule. torch's pinned (CUDA host)
caching allocator rounds every request up to a power of two (``CachingHostAllocator.h``,
default settings), so a buffer of 1.25 GiB pins 2 GiB. ``HostBufferPool`` therefore asks
only for power-of-two slabs and carves its buffers out of them (``slab_layout``); what it
reports, what the dry run counts (the marked slabs) and what the simulator estimates
(``pool_bytes``) are the slabs' bytes: what the host really gives. No torch here: the
simulator uses the rule too.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

_observers: list[Callable] = []


def host_buffer(t):
    """Mark ``t`` (a freshly allocated host buffer) as host-resident; returns ``t``."""
    for fn in _observers:
        fn(t)
    return t


def observed() -> bool:
    """Whether anything (the dry run) is observing host buffers: callers that must walk
    tensors to mark them skip the walk otherwise."""
    return bool(_observers)


@contextlib.contextmanager
def observing(fn: Callable) -> Iterator[None]:
    """Call ``fn(tensor)`` for every host buffer marked while the block runs."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


# ---------------------------------------------------------------- host allocation rule

ALIGN = 512  # bytes: every carved buffer starts at a multiple (any dtype, DMA-friendly)
SLAB_WASTE = 16  # a slab should leave at most 1/16 of itself unused ...
SLAB_BUFFERS = 4  # ... with at most 4 buffers in it (a pool's last slab wastes at most 3)


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's pinned host allocator takes for a request of ``nbytes``: the next
    power of two (``c10::llvm::PowerOf2Ceil``; its ``pinned_max_round_threshold`` setting
    is unlimited by default)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def buffer_stride(nbytes: int) -> int:
    """Bytes one carved buffer of ``nbytes`` occupies in its slab (aligned)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def slab_layout(nbytes: int) -> tuple[int, int]:
    """(slab bytes, buffers per slab) for buffers of ``nbytes``: the smallest power-of-two
    slab of at most ``SLAB_BUFFERS`` buffers that leaves at most 1/``SLAB_WASTE`` of itself
    unused; failing that, the one of them that leaves the least. Slabs are powers of two,
    so the pinned allocator rounds nothing: a power-of-two buffer gets a slab of its own
    size, 1.25 MiB buffers go 3 to a 4 MiB slab, 160 MiB ones 3 to 512 MiB, 2.5 GiB ones
    3 to 8 GiB, and where no such slab exists the loss is what is left (a 3 GiB buffer
    takes 4 GiB, 25%)."""
    stride = buffer_stride(nbytes)
    slab = pinned_block_bytes(stride)
    best = slab
    while slab // stride <= SLAB_BUFFERS:
        waste = slab % stride
        if waste * SLAB_WASTE <= slab:
            return slab, slab // stride
        if waste * best < (best % stride) * slab:  # a smaller fraction unused
            best = slab
        slab *= 2
    return best, best // stride


def pool_bytes(buffers: Mapping[int, int]) -> int:
    """Host bytes a ``HostBufferPool`` holding ``buffers`` ({buffer bytes: how many}) has
    allocated: each size fills its own slabs (``slab_layout``), so the figure does not
    depend on the order the buffers were taken in."""
    total = 0
    for nbytes, count in buffers.items():
        if count > 0 and nbytes > 0:
            slab, per_slab = slab_layout(nbytes)
            total += -(-int(count) // per_slab) * slab
    return total
