"""Pieces of FPDT on their own: layout, all-to-all, kernels, merge, offload store, config errors."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from megatron_weipipe.fpdt import (
    AttentionSpec,
    ChunkStore,
    CommCounter,
    FPDTConfig,
    MathKernel,
    OffloadStats,
    RotaryConfig,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    fpdt_attention,
    global_order,
    local_token_indices,
    merge,
    select_kernel,
    shard,
    shard_batch,
    unshard,
)
from megatron_weipipe.fpdt.kernels import CpuFlashKernel, self_check
from megatron_weipipe.fpdt.rotary import RotaryTable, apply_rotary, apply_rotary_backward
from fpdt_modules import FPDTSelfAttention
from harness import run_distributed

# ---------------------------------------------------------------- layout


def test_layout_one_chunk_is_contiguous_ulysses():
    for P in (1, 2, 4):
        for r in range(P):
            assert local_token_indices(32, P, r, 1).tolist() == list(range(r * 32 // P, (r + 1) * 32 // P))


def test_layout_pieces_and_chunk_blocks():
    S, P, u = 48, 3, 4
    L = S // (u * P)
    for r in range(P):
        idx = local_token_indices(S, P, r, u)
        for j in range(u):  # local chunk j is global piece j*P + r
            assert idx[j * L : (j + 1) * L].tolist() == list(range((j * P + r) * L, (j * P + r + 1) * L))
    # chunk j of every rank, concatenated in rank order, is the global block [jC, (j+1)C)
    C = S // u
    for j in range(u):
        block = torch.cat([local_token_indices(S, P, r, u)[j * L : (j + 1) * L] for r in range(P)])
        assert block.tolist() == list(range(j * C, (j + 1) * C))
    assert sorted(global_order(S, P, u).tolist()) == list(range(S))


def test_shard_unshard_roundtrip_and_batch():
    b, S, P, u = 2, 32, 4, 2
    tokens = torch.arange(b * S).view(b, S)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, S), "position_ids": torch.arange(S).expand(b, S), "attention_mask": None}
    shards = [shard_batch(batch, P, r, u) for r in range(P)]
    for key in ("tokens", "labels", "position_ids"):
        assert torch.equal(unshard([s[key] for s in shards], u, dim=1), batch[key])
    assert shards[1]["attention_mask"] is None
    # labels stay aligned with their tokens after the permutation
    for s in shards:
        assert torch.equal(s["labels"], s["tokens"] + 1)
        assert torch.equal(s["position_ids"][0], s["tokens"][0])
    x = torch.randn(S, 3, 5)
    assert torch.equal(unshard([shard(x, P, r, u, dim=0) for r in range(P)], u, dim=0), x)


# ---------------------------------------------------------------- config errors


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_configs_raise_one_line_value_errors():
    spec = AttentionSpec(32, 4, 8, 2)
    _one_line_error(lambda: FPDTConfig(chunk_size=6).validate(24, 4), "must be divisible by --context-parallel-size")
    _one_line_error(lambda: FPDTConfig(chunk_size=5).validate(24, 1), "must be a multiple of --fpdt-chunk-size")
    _one_line_error(lambda: FPDTConfig(chunk_size=64).validate(32, 2), "must not exceed --seq-length")
    _one_line_error(lambda: AttentionSpec(32, 6, 8, 6).validate(4), r"num_heads \(per TP rank\) \(6\) must be divisible by context")
    _one_line_error(lambda: AttentionSpec(32, 12, 8, 3).validate(4), r"num_query_groups \(per TP rank\) \(3\) must divide or be")
    assert spec.kv_replicas(4) == 2 and spec.kv_replicas(2) == 1  # 2 KV heads over 4 ranks: each sent to 2
    _one_line_error(lambda: AttentionSpec(32, 4, 8, attn_mask_type="padding").validate(1), "causal only")
    _one_line_error(lambda: AttentionSpec(32, 4, 8, attention_dropout=0.1).validate(1), "attention_dropout")
    _one_line_error(lambda: AttentionSpec(32, 4, 8, 3).validate(1), "multiple of num_query_groups")
    _one_line_error(lambda: FPDTConfig(kernel="triton").validate(32, 1), "kernel=")
    _one_line_error(lambda: RotaryConfig(percent=0.1).validate(8), "rotary dimension")
    x = torch.randn(16, 1, 32)
    w = torch.randn(spec.qkv_size, 32)
    wp = torch.randn(32, 32)
    _one_line_error(lambda: fpdt_attention(x, w, None, wp, None, spec, FPDTConfig(chunk_size=32)), "must not exceed")
    _one_line_error(lambda: fpdt_attention(x, w[:-1], None, wp, None, spec, FPDTConfig(chunk_size=None)), "linear_qkv weight")
    bad_mask = AttentionSpec(32, 4, 8, 2, attn_mask_type="bidirectional")
    _one_line_error(lambda: fpdt_attention(x, w, None, wp, None, bad_mask, FPDTConfig(chunk_size=None)), "causal only")
    mod = FPDTSelfAttention(spec, FPDTConfig(chunk_size=None))
    _one_line_error(lambda: mod(x, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool)), "causal only")


# ---------------------------------------------------------------- kernels, merge, rotary


def test_math_kernel_matches_sdpa_float64_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 8, dtype=torch.float64), torch.randn(2, 2, 8, 8, dtype=torch.float64), torch.randn(2, 2, 8, 8, dtype=torch.float64)
    out, lse = MathKernel().forward(q, k, v, True, 0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert (out - ref).abs().max() < 1e-14
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-13


def test_merge_of_key_blocks_equals_whole():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 18, 4, dtype=torch.float64), torch.randn(1, 2, 18, 4, dtype=torch.float64)
    kern = MathKernel()
    whole, whole_lse = kern.forward(q, k, v, False, 0.5)
    o, lse = kern.forward(q, k[:, :, :6], v[:, :, :6], False, 0.5)
    for lo in (6, 12):
        ob, lb = kern.forward(q, k[:, :, lo : lo + 6], v[:, :, lo : lo + 6], False, 0.5)
        o, lse = merge(o, lse, ob, lb)
    assert (o - whole).abs().max() < 1e-14 and (lse - whole_lse).abs().max() < 1e-13


def test_cpu_flash_kernel_agrees_with_math():
    err = self_check(CpuFlashKernel(), "cpu", torch.float32, s=32, d=16)
    assert err < 1e-4


def test_kernel_choice_and_errors():
    assert select_kernel("auto", "cpu", torch.float64, 8).name == "math"
    assert select_kernel("auto", "cpu", torch.float32, 8).name == "cpu_flash"
    assert select_kernel("auto", "cpu", torch.bfloat16, 8).name == "cpu_flash"
    assert select_kernel("math", "cpu", torch.float32, 8).name == "math"
    with pytest.raises(ValueError):
        select_kernel("cuda_flash", "cpu", torch.bfloat16, 8)
    with pytest.raises(ValueError):
        select_kernel("cpu_flash", "cpu", torch.float64, 8)


def test_rotary_backward_is_transpose():
    torch.manual_seed(2)
    for cfg in (RotaryConfig(percent=0.5), RotaryConfig(interleaved=True)):
        table = RotaryTable(cfg, 8, start=40, length=6, dtype=torch.float64, device="cpu")
        x = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
        g = torch.randn(2, 3, 6, 8, dtype=torch.float64)
        apply_rotary(x, table).backward(g)
        assert (apply_rotary_backward(g, table) - x.grad).abs().max() < 1e-14


def test_bf16_runs_on_cpu_flash():
    spec = AttentionSpec(32, 4, 8, 2)
    torch.manual_seed(3)
    x = torch.randn(32, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(spec.qkv_size, 32) * 0.2).bfloat16().requires_grad_(True)
    wp = (torch.randn(32, 32) * 0.2).bfloat16().requires_grad_(True)
    one = fpdt_attention(x, w, None, wp, None, spec, FPDTConfig(chunk_size=None))
    four = fpdt_attention(x, w, None, wp, None, spec, FPDTConfig(chunk_size=8, offload=True))
    assert (one.float() - four.float()).abs().max() < 0.05
    four.float().sum().backward()
    assert torch.isfinite(x.grad.float()).all() and x.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- offload store


def test_store_counts_and_limits_resident_chunks():
    store = ChunkStore("cpu", offload=True)
    for i in range(4):
        store.put("kv", i, k=torch.full((2, 3), float(i)), v=torch.full((2, 3), -float(i)))
    store.prefetch("kv", 0)
    store.prefetch("kv", 1)
    assert store.resident("kv") == 2
    with pytest.raises(RuntimeError, match="limit 2"):
        store.prefetch("kv", 2)
    got = store.get("kv", 1)
    assert torch.equal(got["k"], torch.full((2, 3), 1.0)) and torch.equal(got["v"], torch.full((2, 3), -1.0))
    store.release("kv", 0)
    store.release("kv", 1)
    store.prefetch("kv", 2)
    assert store.get("kv", 2)["k"][0, 0].item() == 2.0
    assert store.stats.max_resident["kv"] == 2
    assert store.stats.d2h_bytes == 4 * 2 * 6 * 4 and store.stats.h2d_bytes == 3 * 2 * 6 * 4


def test_store_offload_copies_are_independent_of_device_tensors():
    store = ChunkStore("cpu", offload=True)
    t = torch.ones(3)
    store.put("q", 0, q=t)
    t.mul_(5)  # the caller may reuse or free its tensor after put()
    assert store.get("q", 0)["q"].tolist() == [1.0, 1.0, 1.0]


def test_store_without_offload_keeps_tensors():
    store = ChunkStore("cpu", offload=False)
    t = torch.ones(3)
    store.put("q", 0, q=t)
    assert store.get("q", 0)["q"] is t
    assert store.stats.d2h_bytes == 0


def test_host_buffers_are_reused_across_iterations():
    spec = AttentionSpec(32, 4, 8, 2)
    mod = FPDTSelfAttention(spec, FPDTConfig(chunk_size=8, offload=True), dtype=torch.float64)
    x = torch.randn(32, 2, 32, dtype=torch.float64, requires_grad=True)
    allocations = []
    for _ in range(3):
        out, bias = mod(x)
        (out + bias).sum().backward()
        allocations.append(mod.pool.allocations)
    assert allocations[0] > 0 and allocations[0] == allocations[1] == allocations[2]
    assert 0 < max(mod.offload_stats.max_resident.values()) <= 2


def test_two_microbatches_in_flight_take_two_buffer_sets():
    """A pipeline schedule runs several forwards before their backwards."""
    spec = AttentionSpec(32, 4, 8, 2)
    mod = FPDTSelfAttention(spec, FPDTConfig(chunk_size=8, offload=True), dtype=torch.float64)
    xs = [torch.randn(32, 1, 32, dtype=torch.float64) for _ in range(2)]
    refs = [fpdt_attention(x, mod.linear_qkv.weight, mod.linear_qkv.bias, mod.linear_proj.weight, None, spec, FPDTConfig(chunk_size=None)) for x in xs]
    grads_ref = [torch.autograd.grad(r.sum(), mod.linear_qkv.weight)[0] for r in refs]
    for _ in range(2):
        outs = [mod(x)[0] for x in xs]  # both forwards first
        grads = [torch.autograd.grad(o.sum(), mod.linear_qkv.weight)[0] for o in reversed(outs)][::-1]
        for g, r in zip(grads, grads_ref):
            assert (g - r).abs().max() < 1e-12
    first = mod.pool.allocations
    outs = [mod(x)[0] for x in xs]
    [o.sum().backward() for o in outs]
    assert mod.pool.allocations == first


# ---------------------------------------------------------------- all-to-all (2 gloo ranks)


def _a2a_run(rank, world):
    group = dist.group.WORLD
    res = {}
    # [s/P, b, h, d] with value encoding (global token, head)
    s_l, b, h, d = 3, 2, 4, 5
    tok = torch.arange(s_l) + rank * s_l
    x = (tok[:, None, None, None] * 100 + torch.arange(h)[None, None, :, None] + 0.0).expand(s_l, b, h, d).double()
    x = x + torch.arange(b)[None, :, None, None] * 0.5
    counter = CommCounter()
    xh = all_to_all_seq_to_heads(x.clone().requires_grad_(True), group, counter)
    hp = h // world
    expect = (torch.arange(s_l * world)[:, None, None, None] * 100 + (rank * hp + torch.arange(hp))[None, None, :, None] + 0.0)
    expect = expect.expand(s_l * world, b, hp, d).double() + torch.arange(b)[None, :, None, None] * 0.5
    res["s2h"] = torch.equal(xh.detach(), expect)
    back = all_to_all_heads_to_seq(xh.detach(), group, counter)
    res["roundtrip"] = torch.equal(back, x)
    # backward of seq->heads is heads->seq: gradient of sum(w * y) is w mapped back
    xr = x.clone().requires_grad_(True)
    w = torch.randn(xh.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (all_to_all_seq_to_heads(xr, group) * w).sum().backward()
    res["grad"] = torch.equal(xr.grad, all_to_all_heads_to_seq(w, group))
    res["bytes"] = counter.bytes_sent
    res["bf16"] = torch.equal(all_to_all_heads_to_seq(all_to_all_seq_to_heads(x.bfloat16(), group), group), x.bfloat16())
    return res


def test_ulysses_all_to_all_on_gloo():
    for res in run_distributed(_a2a_run, 2, timeout=120):
        assert res["s2h"] and res["roundtrip"] and res["grad"] and res["bf16"], res
        assert res["bytes"] == 2 * (3 * 2 * 4 * 5 * 8) // 2  # two calls, half of each tensor leaves the rank


def test_offload_keeps_chunk_state_on_device_o_of_chunk():
    """Counted bytes of chunk state on the device: O(S) without offload, O(C) with it."""
    spec = AttentionSpec(32, 4, 8, 2)
    x = torch.randn(64, 1, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(spec.qkv_size, 32, dtype=torch.float64, requires_grad=True)
    wp = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    peaks = {}
    for off in (False, True):
        stats = OffloadStats()
        fpdt_attention(x, w, None, wp, None, spec, FPDTConfig(chunk_size=4, offload=off), stats=stats).sum().backward()
        assert stats.device_bytes == 0  # everything released after the backward
        peaks[off] = stats.peak_device_bytes
    # 16 chunks: without offload every chunk's q, k, v, o, lse, do, dq is held at once;
    # with offload at most two chunks per stream are.
    assert peaks[True] * 4 < peaks[False]


def test_no_grad_forward_keeps_only_kv():
    spec = AttentionSpec(32, 4, 8, 2)
    x = torch.randn(32, 1, 32, dtype=torch.float64)
    w = torch.randn(spec.qkv_size, 32, dtype=torch.float64, requires_grad=True)
    wp = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    cfg = FPDTConfig(chunk_size=8, offload=True)
    with_grad = fpdt_attention(x, w, None, wp, None, spec, cfg)
    stats = OffloadStats()
    with torch.no_grad():
        inference = fpdt_attention(x, w, None, wp, None, spec, cfg, stats=stats)
    assert torch.equal(inference, with_grad.detach()) and not inference.requires_grad
    kv_bytes = 4 * 2 * (8 * 2 * 8 * 8)  # 4 chunks of k and v, [b=1, 2 kv heads, C=8, d=8] float64
    assert stats.d2h_bytes == kv_bytes and stats.device_bytes == 0


def test_longest_fitting_doubles_then_bisects():
    from bench.fpdt_util import longest_fitting

    seen = []

    def fits(n):
        seen.append(n)
        return n <= 5000

    assert longest_fitting(fits, 256, 256, 65536) == 4864
    assert seen[:6] == [256, 512, 1024, 2048, 4096, 8192]
    assert longest_fitting(lambda n: True, 256, 256, 1024) == 1024
    assert longest_fitting(lambda n: False, 256, 256, 1024) == 0


def test_chunk_counts_from_config():
    cfg = FPDTConfig(chunk_size=1024)
    assert cfg.validate(8192, 2) == 8 and cfg.mlp_num_chunks(8192) == 8 and cfg.loss_num_chunks(8192) == 8
    cfg = FPDTConfig(chunk_size=1024, mlp_chunks=2, loss_chunks=16)
    assert cfg.mlp_num_chunks(8192) == 2 and cfg.loss_num_chunks(8192) == 16
    assert FPDTConfig(chunk_size=None).validate(8192, 4) == 1
    _one_line_error(lambda: FPDTConfig(chunk_size=None, mlp_chunks=3).validate(64, 2), "mlp_chunks=3")
