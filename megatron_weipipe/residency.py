"""Which tensors live in host memory on purpose: the buffers offload code keeps there.

On a CPU host every tensor is a "cpu" tensor, so the device type cannot tell an offloaded
buffer from an activation. Offload code therefore names its host buffers: every
allocation that is meant to stay in host memory while the accelerator works (FPDT's
``HostBufferPool``, whole-layer activation offload, ...) passes through ``host_buffer``
right after it is made. Observers (``tools/dry_run.py`` counts such storages as host
bytes, not accelerator bytes) register with ``observing``; with none registered the call
costs one list check. Only the first call per storage matters; a view of a marked buffer
shares its storage and needs no mark.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_observers: list[Callable] = []


def host_buffer(t):
    """Mark ``t`` (a freshly allocated host buffer) as host-resident; returns ``t``."""
    for fn in _observers:
        fn(t)
    return t


@contextlib.contextmanager
def observing(fn: Callable) -> Iterator[None]:
    """Call ``fn(tensor)`` for every host buffer marked while the block runs."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)
