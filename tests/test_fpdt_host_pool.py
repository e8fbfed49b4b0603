"""--fpdt-offload: all attention layers of a model share one HostBufferPool, exactly.

A 4-layer Llama-style model (FPDT, 4 chunks, float32) trains 3 steps with and without
--fpdt-offload, under full recomputation and without it, and on 2 ranks under
megatron-core's 1F1B and weipipe-interleave (several micro-batches in flight). Every
buffer given back to a pool is filled with NaN at once, so a buffer given back (or
handed to another layer) while still live would spoil the gradients: the offloaded runs
must equal the runs without offload bit for bit. The pool's size is checked against one
layer's forward/backward pair replayed alone on a fresh pool: under recomputation the
model's single pool holds exactly that; without it, every other layer's forward set more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import run_distributed
from harness.runs import tiny_gpt_args, train_and_collect

LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
             seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4,
             fpdt=True, fpdt_chunk_size=16)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform")
WORLD1 = {"recompute": RECOMPUTE, "no-recompute": {}}
WORLD2 = {"1f1b-pp2": dict(pipeline_model_parallel_size=2),
          "weipipe-interleave-ring2": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave")}


def _instrumented(rank, world_size, configs, replay):
    """Train each configuration without and with --fpdt-offload, with poisoned give-backs;
    return both runs, the offloaded run's pools and (if ``replay``) one layer's pool alone."""
    from megatron_weipipe.fpdt import offload
    from megatron_weipipe.model import long_context

    pools, calls = [], []
    init, give, attention = offload.HostBufferPool.__init__, offload.HostBufferPool.give, long_context.fpdt_attention

    def recording_init(self, *a, **k):
        init(self, *a, **k)
        pools.append(self)

    def poisoned_give(self, buf):
        if buf.is_floating_point():
            buf.fill_(float("nan"))
        give(self, buf)

    def recording_attention(h, wq, bq, wp, bp, spec, config, *args, **kwargs):
        if not calls and config.offload:
            calls.append((tuple(h.shape), tuple(wq.shape), tuple(wp.shape), spec, config, args, kwargs["num_chunks"]))
        return attention(h, wq, bq, wp, bp, spec, config, *args, **kwargs)

    offload.HostBufferPool.__init__, offload.HostBufferPool.give = recording_init, poisoned_give
    long_context.fpdt_attention = recording_attention
    out = []
    try:
        for flags in configs:
            plain = train_and_collect(rank, world_size, tiny_gpt_args(**LLAMA, **flags))
            pools.clear()
            offloaded = train_and_collect(rank, world_size, tiny_gpt_args(**LLAMA, **flags, fpdt_offload=True))
            offloaded["pools"] = [(p.allocations, p.buffer_bytes) for p in pools]
            out.append((plain, offloaded))
        if replay:
            out.append(_one_layer(calls[0], offload.HostBufferPool))
    finally:
        offload.HostBufferPool.__init__, offload.HostBufferPool.give = init, give
        long_context.fpdt_attention = attention
    return out


def _one_layer(call, pool_class):
    """One layer's forward and backward on a fresh pool: (allocations, bytes) after the
    forward and after the backward."""
    h_shape, wq_shape, wp_shape, spec, config, args, u = call
    from megatron_weipipe.fpdt import fpdt_attention

    torch.manual_seed(0)
    h = torch.randn(h_shape, requires_grad=True)
    wq, wp = torch.randn(wq_shape, requires_grad=True), torch.randn(wp_shape, requires_grad=True)
    pool = pool_class(pin_memory=False)
    out = fpdt_attention(h, wq, None, wp, None, spec, config, *args, pool=pool, num_chunks=u)
    forward = (pool.allocations, pool.buffer_bytes)
    out.sum().backward()
    return forward, (pool.allocations, pool.buffer_bytes)


def _same_shards(a, b, what):
    assert a.keys() == b.keys() and a, what
    for name, pieces in b.items():
        assert len(a[name]) == len(pieces), f"{what} {name}"
        for (sa, oa, da), (sb, ob, db) in zip(a[name], pieces):  # NaN (a poisoned read) never equals
            assert sa == sb and oa == ob and np.array_equal(da, db), f"{what} {name} differs"


def _assert_bitwise(plain, offloaded):
    assert offloaded["losses"] == plain["losses"] and len(plain["losses"]) == 3
    assert offloaded["grad_norms"] == plain["grad_norms"]
    assert offloaded["grads"].keys() == plain["grads"].keys()
    for it, ref in plain["grads"].items():
        _same_shards(offloaded["grads"][it], ref, f"iteration {it}: gradient of")
    _same_shards(offloaded["params"], plain["params"], "parameter")


@pytest.fixture(scope="module")
def world1():
    (out,) = run_distributed(_instrumented, 1, list(WORLD1.values()), True, timeout=600)
    return dict(zip(WORLD1, out[:-1])), out[-1]


@pytest.fixture(scope="module")
def world2():
    per_rank = run_distributed(_instrumented, 2, list(WORLD2.values()), False, timeout=600)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(WORLD2)}


@pytest.mark.parametrize("layout", list(WORLD1))
def test_offload_with_poisoned_give_back_is_bitwise(layout, world1):
    _assert_bitwise(*world1[0][layout])


def test_recompute_pool_holds_one_layer(world1):
    runs, (_, one_layer) = world1
    assert one_layer[0] > 0
    assert runs["recompute"][1]["pools"] == [one_layer]  # one pool for 4 layers, one layer's buffers


def test_pool_without_recompute_holds_every_forward_set(world1):
    runs, (forward, one_layer) = world1
    expected = (one_layer[0] + 3 * forward[0], one_layer[1] + 3 * forward[1])  # 3 more layers' forward sets
    assert runs["no-recompute"][1]["pools"] == [expected]


@pytest.mark.parametrize("layout", list(WORLD2))
def test_pipelined_offload_with_poisoned_give_back_is_bitwise(layout, world2):
    for plain, offloaded in world2[layout]:
        _assert_bitwise(plain, offloaded)
        assert len(offloaded["pools"]) == 1  # one per rank's model
