"""Whole-model activation offload: the layer inputs that full recomputation keeps, on the host.

With ``--recompute-granularity full`` each recomputed unit (one layer, or
``--recompute-num-layers`` of them; a whole chunk in WeiPipe) keeps only its input,
[s/CP, b, h], between its forward and its backward. With ``--offload-layer-inputs`` that
input is copied to a host buffer after the unit's forward and brought back just before
the unit's recompute; the input whose recompute comes next is prefetched while the
current unit runs its backward. The copies are FPDT's (``fpdt/offload.py``): one
``ChunkStore`` over a ``HostBufferPool`` of its own (pinned on CUDA, carved out of
power-of-two slabs and counted as the slabs, ``residency.slab_layout``; buffers made on
first use and reused by every later unit, microbatch and iteration), the copies through
the pool's copy service (``fpdt/copy_streams.py``: device->host and host->device on two
side streams on CUDA, plain copies into separate host buffers on CPU). At most two inputs
are on the device through the store at once: the one being recomputed and the prefetched one.

Two users: megatron-core's ``TransformerBlock`` (no pipelining, 1F1B, interleaved 1F1B),
where the input megatron-core's ``CheckpointFunction`` saves is caught by saved-tensor
hooks (``install_on_block``), and the WeiPipe runtime, which keeps each chunk's input
itself and hands it to the store (``put`` / ``prefetch`` / ``take``).
"""

from __future__ import annotations

import itertools
from typing import Hashable

import torch

from megatron_weipipe import mcore_versions
from megatron_weipipe.fpdt.offload import ChunkStore, HostBufferPool, OffloadStats
from megatron_weipipe.platform import Platform

STREAM = "layer_input"


class LayerInputStore:
    """Tensors by key on the host, each brought back to the device once."""

    def __init__(self, platform: Platform):
        self.pool = HostBufferPool(pin_memory=platform.pin_memory)
        self.stats = OffloadStats()
        # role: what the dry run calls the restored copies on the device (they are activations)
        self.store = ChunkStore(platform.current_device(), offload=True, pool=self.pool, stats=self.stats,
                                role="activations")

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        """Copy ``t`` to a host buffer; the caller may drop the device tensor right after."""
        self.store.put(STREAM, key, x=t.detach())

    def holds(self, key: Hashable) -> bool:
        return self.store.has(STREAM, key, "x")

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back (no-op if it is not on the host)."""
        if self.holds(key):
            self.store.prefetch(STREAM, key)

    def take(self, key: Hashable) -> torch.Tensor:
        """The device copy of ``key`` (waits for its prefetch); its host buffer goes back to the pool."""
        if not self.holds(key):
            raise KeyError(f"layer input {key!r} is not on the host (restored twice?)")
        x = self.store.get(STREAM, key)["x"]
        self.store.drop(STREAM, key)
        return x

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` without restoring it (its graph was freed without a backward)."""
        self.store.drop(STREAM, key)


class _Offloaded:
    """What the pack hook leaves in the graph: the key of the host copy."""

    __slots__ = ("store", "key", "taken")

    def __init__(self, store: LayerInputStore, key):
        self.store, self.key, self.taken = store, key, False

    def __del__(self):
        if not self.taken:
            try:
                self.store.discard(self.key)
            except Exception:  # interpreter shutdown
                pass


def install_on_block(block: torch.nn.Module, store: LayerInputStore) -> None:
    """Offload the inputs megatron-core's recomputation saves in ``block`` (a TransformerBlock).

    megatron-core's ``CheckpointFunction`` saves its arguments for the recompute; the
    first is the unit's hidden states: the block's input, or the output of the unit before
    (made by a ``CheckpointFunction``). Inside the block's checkpointed forward a pack hook
    sends each saved tensor of that kind (and of the block input's shape and dtype) to the
    store, and the unpack hook brings it back and prefetches the previous unit's input of
    the same forward (the next recompute in backward order). Everything else saved there
    (the RoPE table, masks, what the layers run without recomputation under
    ``--recompute-method block`` save, except the first one's input, a unit output) stays
    as it is, and so does a leaf input (a later pipeline stage's received tensor, which
    the schedule keeps anyway). Restored tensors are exact copies either way.
    """
    from megatron.core.tensor_parallel.random import CheckpointFunction

    unit_output = CheckpointFunction._backward_cls

    forwards = itertools.count()

    def wrap(original):
        def checkpointed_forward(hidden_states, *args, **kwargs):
            group, units = next(forwards), itertools.count()
            shape, dtype, first = hidden_states.shape, hidden_states.dtype, hidden_states.grad_fn

            def pack(t):
                fn = t.grad_fn
                if fn is None or t.shape != shape or t.dtype != dtype or not (fn is first or type(fn) is unit_output):
                    return t
                key = (group, next(units))
                store.put(key, t)
                return _Offloaded(store, key)

            def unpack(saved):
                if not isinstance(saved, _Offloaded):
                    return saved
                x = store.take(saved.key)
                saved.taken = True
                store.prefetch((saved.key[0], saved.key[1] - 1))
                return x

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return original(hidden_states, *args, **kwargs)

        return checkpointed_forward

    mcore_versions.wrap_checkpointed_forward(block, wrap)
    block.layer_input_store = store
