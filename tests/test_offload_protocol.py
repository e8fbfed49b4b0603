"""The offload copies' stream/event protocol, checked on CUDA's code path without a GPU.

GPU defects guarded (issue 25, item 6): a prefetch that reads a host buffer before its
device->host copy has landed, a compute kernel that uses a prefetched chunk before its
copy is done, a device tensor freed (and its memory reused by the caching allocator)
while a side-stream copy still reads it (a missing ``record_stream``), a host buffer
given back to the pool and overwritten while an earlier prefetch still reads it, copies
left in flight after the backward, a host synchronization per chunk, and one copy stream
for both directions (PCIe half-duplex: the backward's chunk loop sends dq back while it
fetches the next chunk, so it turns copy-bound once chunks drop below about 16-20K tokens).

The stores run their CUDA branch (device "cuda") on CPU tensors, with torch.cuda's
streams, events and ``record_stream`` replaced by the logging fakes of
``stream_protocol``, which check every rule over the whole log (not call counts), so the
checks hold whatever the copy code does. Driven: FPDT attention forward and backward with
offload (two micro-batches in flight, a second iteration on the same pool), the
buffer-reuse case no current FPDT path produces (a prefetch never used), and a
recomputed stack with ``--offload-layer-inputs``' store and FPDT offload in each unit.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from stream_protocol import StreamWorld

from megatron_weipipe.fpdt import chunked_attention as fpdt_module
from megatron_weipipe.fpdt.config import AttentionSpec, FPDTConfig
from megatron_weipipe.fpdt.offload import ChunkStore, HostBufferPool

SPEC = AttentionSpec(32, 4, 8, 2)
CONFIG = FPDTConfig(chunk_size=8, offload=True)


@pytest.fixture
def cuda_stores(monkeypatch):
    """FPDT's ChunkStores take their CUDA branch while every tensor stays on the CPU."""
    real = fpdt_module.ChunkStore
    monkeypatch.setattr(fpdt_module, "ChunkStore", lambda device, *a, **k: real(torch.device("cuda"), *a, **k))


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(SPEC.qkv_size, SPEC.hidden_size, generator=g, dtype=torch.float64) * 0.2
    wp = torch.randn(SPEC.hidden_size, SPEC.proj_input_size, generator=g, dtype=torch.float64) * 0.2
    return wq.requires_grad_(), wp.requires_grad_()


def _two_microbatches(config, pool, iterations=2):
    """Both forwards, then both backwards, ``iterations`` times: outputs and gradients."""
    wq, wp = _weights()
    xs = [torch.randn(32, 2, SPEC.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          .requires_grad_() for i in range(2)]
    results = []
    for _ in range(iterations):
        outs = [fpdt_module.fpdt_attention(x, wq, None, wp, None, SPEC, config, pool=pool) for x in xs]
        for o in reversed(outs):
            o.square().sum().backward()
        results.append([o.detach().clone() for o in outs] + [t.grad.clone() for t in (*xs, wq, wp)])
        for t in (*xs, wq, wp):
            t.grad = None
    return results


def _checked(run):
    world = StreamWorld()
    with world.installed():
        out = run()
    world.check_drained()
    world.check_directions()
    return world, out


def test_fpdt_offload_copies_follow_the_protocol(cuda_stores):
    reference = _two_microbatches(FPDTConfig(chunk_size=8), None)
    world, offloaded = _checked(lambda: _two_microbatches(CONFIG, HostBufferPool()))
    assert world.violations == [], "\n".join(world.violations[:20])
    assert world.copies["d2h"] > 0 and world.copies["h2d"] > 0, world.copies
    for got, want in zip(offloaded, reference):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_a_buffer_taken_again_waits_for_an_unused_prefetch():
    """Chunk a is prefetched and dropped unused; chunk b takes its host buffer at once."""

    def run():
        store = ChunkStore("cuda", offload=True, pool=HostBufferPool())
        store.put("kv", 0, k=torch.randn(4, 8))
        store.prefetch("kv", 0)
        store.drop("kv", 0)  # its buffer back to the pool, the prefetch maybe still queued
        store.put("kv", 1, k=torch.randn(4, 8))  # the same buffer
        assert store.pool.allocations == 1
        kv = store.get("kv", 1)["k"] * 1.0
        store.close()
        return kv

    world, _ = _checked(run)
    assert world.violations == [], "\n".join(world.violations)


def _stack_protocol(rank, world_size):
    """A 3-unit stack under megatron-core's CheckpointFunction, --offload-layer-inputs'
    store and FPDT offload (its own pool) in every unit, through the fakes."""
    from megatron.core import tensor_parallel

    from megatron_weipipe.model import layer_offload
    from megatron_weipipe.platform import Platform, install_cpu_adapter

    install_cpu_adapter()
    real = fpdt_module.ChunkStore
    fpdt_module.ChunkStore = lambda device, *a, **k: real(torch.device("cuda"), *a, **k)
    wq, wp = _weights()
    pool = HostBufferPool()

    class Stack(torch.nn.Module):
        def _checkpointed_forward(self, hidden_states):
            h = hidden_states
            for _ in range(3):
                h = tensor_parallel.checkpoint(
                    lambda t: t + fpdt_module.fpdt_attention(t, wq, None, wp, None, SPEC, CONFIG, pool=pool), False, h)
            return h

    def run():
        stack = Stack()
        store = layer_offload.LayerInputStore(Platform("cuda", "gloo"))
        layer_offload.install_on_block(stack, store)
        x = torch.randn(32, 2, SPEC.hidden_size, dtype=torch.float64).requires_grad_()
        stack._checkpointed_forward(x * 1.0).square().sum().backward()
        return store.stats.fetches

    world, fetches = _checked(run)
    return world.violations, world.copies, fetches


def test_layer_input_store_and_fpdt_in_a_recomputed_stack_follow_the_protocol():
    (violations, copies, fetches), = run_distributed(_stack_protocol, 1, timeout=300)
    assert violations == [], "\n".join(violations[:20])
    assert fetches == 3 and copies["d2h"] > 0 and copies["h2d"] > 0, (fetches, copies)


def test_the_checker_sees_a_missing_wait(cuda_stores):
    """Each rule can fail: copy services with one wait (or record_stream) left out."""
    from megatron_weipipe.fpdt import copy_streams

    class NoWaitBeforeUse(copy_streams.CudaCopyStreams):
        def ready(self, tensors, marker):
            for t in tensors:
                t.record_stream(torch.cuda.current_stream())

    class NoRecordStream(copy_streams.CudaCopyStreams):
        def to_host(self, dst, src, fence):
            self.d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
                fence.written = self._event(self.d2h)

    class OneStream(copy_streams.CudaCopyStreams):
        def __init__(self, device):
            super().__init__(device)
            self.h2d = self.d2h

    expected = {NoWaitBeforeUse: "unordered read", NoRecordStream: "no record_stream(side1)",
                OneStream: "carries both"}
    for cls, message in expected.items():
        pool = HostBufferPool(copy_streams=None)
        world = StreamWorld()
        with world.installed():
            pool._copy_streams = cls(torch.device("cuda"))
            _two_microbatches(CONFIG, pool, iterations=1)
        world.check_drained()
        world.check_directions()
        assert any(message in v for v in world.violations), (cls.__name__, world.violations[:5])
