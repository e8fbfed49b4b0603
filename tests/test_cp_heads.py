"""Context parallelism beyond the KV heads: each KV head sent to the ranks of its query heads.

With CP x TP larger than --num-query-groups, Ulysses and FPDT spread each KV head over
the CP x TP / groups ranks that hold its query heads (``spread_kv``) and sum the
replicas' gradients back (``gather_kv``). Checked here, in one world of 4 gloo ranks:
- the attention against the single-process reference (tests/fpdt_reference.py): float64
  within 1e-10, float32 within 1e-5, output and every gradient, for Ulysses, FPDT with
  several chunks, offload, TP x CP, 1 and 2 KV heads, and packed documents;
- the bytes of the all-to-alls, from the process byte counter and CommCounter, against
  the same attention with every KV head expanded to its query heads before sending;
- the GPT model (2 KV heads, CP = 4) against the CP = 1 run of the same world (data
  parallel over the 4 ranks, no Ulysses, the dense document mask): losses,
  every gradient and every parameter within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.fpdt import AttentionSpec, CommCounter, cp_heads_fit, gather_kv, spread_kv, ulysses_attention
from megatron_weipipe.fpdt import shard
from fpdt_reference import HEAD_DIM, HIDDEN, make_case
from harness import run_distributed
from harness.runs import merge_ranks, tiny_gpt_args, train_and_collect
from harness.state import max_relative_difference

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
RTOL = 1e-5
P = 4

KERNEL_CASES = [  # test_fpdt_attention.run_case's configurations, at CP = 4 unless "tp"
    dict(heads=4, groups=2, S=32, b=2, u=1, offload=False, bias=True, seed=1, ulysses=True),
    dict(heads=8, groups=2, S=32, b=1, u=2, offload=True, bias=True, seed=2),
    dict(heads=4, groups=2, S=32, b=2, u=4, offload=False, bias=False, seed=3, percent=0.5),
    dict(heads=4, groups=1, S=32, b=2, u=2, offload=True, bias=True, seed=4, overlap=False),
    dict(heads=4, groups=1, S=32, b=1, u=1, offload=False, bias=False, seed=5, ulysses=True),
    dict(heads=8, groups=2, S=32, b=2, u=2, offload=True, bias=True, seed=6, dtype=torch.float32),
    dict(heads=4, groups=2, S=16, b=2, u=2, offload=True, bias=True, seed=7, tp=True),  # TP2 x CP2, 1 KV head per TP rank
    dict(heads=4, groups=2, S=16, b=1, u=1, offload=False, bias=True, seed=8, tp=True, ulysses=True),
]
PACKED_CASES = [  # test_fpdt_packed.run_case (4 heads, 2 KV heads), documents crossing chunks and ranks
    dict(layout="mixed", u=2, seed=11, offload=True),
    dict(layout="mixed", u=4, seed=12, min_segment=1),
    dict(layout="singletons", u=1, seed=13),
    dict(layout="mixed", u=1, seed=14, tile=8),
]

LLAMA = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4, micro_batch_size=1,
)
PACKED = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
RUNS = {  # name: (flags, the CP = 1 run it must match)
    "reference": (dict(), None),
    "ulysses-cp4": (dict(context_parallel_size=4), "reference"),
    "fpdt-cp4-offload": (dict(context_parallel_size=4, fpdt=True, fpdt_chunk_size=16, fpdt_offload=True), "reference"),
    "packed-reference": (dict(PACKED), None),
    "packed-fpdt-cp4": (dict(PACKED, context_parallel_size=4, fpdt=True, fpdt_chunk_size=32), "packed-reference"),
}


def _args(**overrides):
    return tiny_gpt_args(**dict(LLAMA, **overrides))


def _bytes(rank, world):
    """All-to-all bytes of one Ulysses forward + backward (8 query heads, 2 KV heads, CP = 4):
    send-once, and the same attention with each KV head expanded to its 4 query heads."""
    from megatron_weipipe.byte_counter import process_byte_counter

    counter = process_byte_counter()
    S, b, heads, groups, d = 32, 1, 8, 2, HEAD_DIM
    out = {}
    for name, g in (("send-once", groups), ("expanded", heads)):
        spec = AttentionSpec(HIDDEN, heads, d, g, rotary=None)
        case = make_case(S, b, AttentionSpec(HIDDEN, heads, d, groups, rotary=None), False, 21)
        wq = case["wq"].view(groups, heads // groups + 2, d, HIDDEN)
        if g == heads:  # MHA weights with each KV head's rows repeated: the same attention
            q = wq[:, :-2].reshape(heads, 1, d, HIDDEN)
            kv = wq[:, -2:].repeat_interleave(heads // groups, dim=0)
            wq = torch.cat([q, kv], dim=1)
        x = shard(case["x"], world, rank, 1, dim=0).requires_grad_(True)
        comm = CommCounter()
        counter.reset()
        y = ulysses_attention(x, wq.reshape(-1, HIDDEN), None, case["wp"], None, spec, dist.group.WORLD, counter=comm)
        y.backward(shard(case["dy"], world, rank, 1, dim=0))
        out[name] = dict(sent=comm.bytes_sent, payload=counter.sent.get("collectives", 0), calls=comm.calls,
                         out=y.detach(), dx=x.grad)
    return out


def _world(rank, world):
    from test_fpdt_attention import run_case as attention_case
    from test_fpdt_packed import run_case as packed_case

    res = {"kernels": [], "packed": []}
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    cp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    for cfg in KERNEL_CASES:
        errs = attention_case(cfg, cp, tp) if cfg.get("tp") else attention_case(cfg, dist.group.WORLD)
        res["kernels"].append((cfg, errs))
    for cfg in PACKED_CASES:
        got = packed_case(cfg, dist.group.WORLD)
        res["packed"].append((cfg, dict(got["errs"], counts=got["counts"])))
    res["bytes"] = _bytes(rank, world)
    res["runs"] = [train_and_collect(rank, world, _args(**flags)) for flags, _ in RUNS.values()]
    return res


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world, P, timeout=240)


def test_rule_accepts_kv_heads_dividing_cp_times_tp():
    assert cp_heads_fit(32, 8, 32) == 4  # Llama-3 8B at CP = 32
    assert cp_heads_fit(32, 8, 16, 2) == 4 and cp_heads_fit(32, 8, 4, 2) == 1 and cp_heads_fit(32, 8, 2) == 1
    assert cp_heads_fit(4, 1, 4) == 4
    for heads, groups, cp, tp, part in ((32, 8, 64, 1, "--num-attention-heads (32)"),
                                        (24, 6, 4, 1, "--num-query-groups (6) must divide or be divisible"),
                                        (48, 12, 16, 1, "--num-query-groups (12)")):
        with pytest.raises(ConfigError) as info:
            cp_heads_fit(heads, groups, cp, tp)
        assert part in str(info.value) and "\n" not in str(info.value)


def test_start_up_checks_the_rule():
    cfg = parse_config(_args(context_parallel_size=4, fpdt=True, fpdt_chunk_size=16), world_size=4)
    assert cfg.parallel.context_parallel_size == 4
    with pytest.raises(ConfigError) as info:
        parse_config(_args(num_attention_heads=8, num_query_groups=8, context_parallel_size=16), world_size=16)
    assert "--num-attention-heads (8) must be divisible by context x tensor parallel size (16 x 1)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config(_args(num_attention_heads=12, num_query_groups=3, hidden_size=96, context_parallel_size=4),
                     world_size=4)
    assert "--num-query-groups (3) must divide or be divisible by context x tensor parallel size (4 x 1)" in str(
        info.value)


def test_gather_kv_is_the_adjoint_of_spread_kv():
    gen = torch.Generator().manual_seed(0)
    for groups, g, R in ((2, 4, 2), (1, 4, 4), (2, 2, 2)):
        x = torch.randn(3, 2, groups, (g + 2) * HEAD_DIM, generator=gen, dtype=torch.float64)
        y = torch.randn(3, 2, groups * R, (g // R + 2) * HEAD_DIM, generator=gen, dtype=torch.float64)
        spread = spread_kv(x, R, HEAD_DIM)
        assert spread.shape == y.shape
        lhs, rhs = (spread * y).sum(), (x * gather_kv(y, R, HEAD_DIM)).sum()
        assert abs(lhs - rhs) <= 1e-12 * abs(rhs)
        # each slab carries its group's k, v once and its share of the group's query heads
        slabs = spread.view(3, 2, groups, R, -1)
        assert torch.equal(slabs[..., -2 * HEAD_DIM:], x[..., None, -2 * HEAD_DIM:].expand_as(slabs[..., -2 * HEAD_DIM:]))
        assert torch.equal(slabs[..., : -2 * HEAD_DIM].reshape(3, 2, groups, -1), x[..., : -2 * HEAD_DIM])


def _check(items, names):
    bad = []
    for cfg, errs in items:
        tol = TOL[cfg.get("dtype", torch.float64)]
        for name in names:
            if (name in errs or name in ("out", "dx", "wq", "wp")) and not errs[name] <= tol:
                bad.append(f"{name} err {errs[name]:.2e} > {tol:g} for {cfg}")
        if cfg.get("offload") and errs.get("max_resident", 0) > 2:
            bad.append(f"held {errs['max_resident']} chunks for {cfg}")
    return bad


def test_attention_matches_reference(world4):
    bad = [f"rank {r}: {m}" for r, res in enumerate(world4)
           for m in _check(res["kernels"], ("out", "dx", "wq", "bq", "wp", "bp"))]
    assert not bad, "\n".join(bad[:10])


def test_packed_documents_match_reference(world4):
    names = ("out", "dx", "wq", "bq", "wp", "bp")
    for res in world4:
        assert all(set(names) <= set(errs) for _, errs in res["packed"])
        kinds = {k for _, errs in res["packed"] for k, n in errs["counts"].items() if n}
        assert {"skip", "masked"} <= kinds, kinds  # blocks skipped and blocks a boundary cuts
    bad = [f"rank {r}: {m}" for r, res in enumerate(world4) for m in _check(res["packed"], names)]
    assert not bad, "\n".join(bad[:10])


def test_all_to_all_sends_each_kv_head_once_per_rank(world4):
    S, b, heads, groups, d, e = 32, 1, 8, 2, HEAD_DIM, 8
    tokens = S // P * b
    # forward: q|k|v (each rank: its 2 query heads and one KV head) and o; backward the same back
    once = 2 * tokens * ((heads + 2 * P) + heads) * d * e
    expanded = 2 * tokens * ((heads + 2 * heads) + heads) * d * e
    for res in world4:
        got = res["bytes"]
        assert got["send-once"]["payload"] == once and got["expanded"]["payload"] == expanded, got
        assert got["send-once"]["sent"] == once * (P - 1) // P  # what leaves the rank
        assert torch.allclose(got["send-once"]["out"], got["expanded"]["out"], rtol=0, atol=1e-12)
        assert torch.allclose(got["send-once"]["dx"], got["expanded"]["dx"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", [n for n, (_, ref) in RUNS.items() if ref])
def test_model_matches_cp1(name, world4):
    names = list(RUNS)
    run, ref = (merge_ranks([r["runs"] for r in world4], names.index(n)) for n in (name, RUNS[name][1]))
    assert len(run["losses"]) == 3
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= RTOL * abs(b), (run["losses"], ref["losses"])
    for it, g in ref["grads"].items():
        rel, where = max_relative_difference(run["grads"][it], g)
        assert rel < RTOL, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(run["params"], ref["params"])
    assert rel < RTOL, f"parameter {where} differs by {rel:.2e}"


def test_packed_reference_mask_matters(world4):
    names = list(RUNS)
    runs = [merge_ranks([r["runs"] for r in world4], names.index(n)) for n in ("reference", "packed-reference")]
    assert max(abs(a - b) for a, b in zip(runs[0]["losses"], runs[1]["losses"])) > 1e-4


def test_estimator_counts_a_shared_kv_head_on_each_rank():
    from megatron_weipipe.fpdt.config import kv_heads_per_rank, ulysses_heads_sent
    from megatron_weipipe.shape import ModelShape
    from megatron_weipipe.simulator.fpdt import FPDTSpec, pool_buffers
    from megatron_weipipe.simulator.memory import ActivationOptions, long_context_layer_bytes

    # the measured all-to-all above: 8 query heads, 2 KV heads, CP 4
    assert ulysses_heads_sent(8, 2, 4) == 8 + 2 * 4 and ulysses_heads_sent(8, 4, 2) == 8 + 2 * 4 // 2 * 2
    assert kv_heads_per_rank(8, 32) == 1 and kv_heads_per_rank(8, 16, 2) == 1 and kv_heads_per_rank(8, 4, 2) == 1
    l8b = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=1 << 24,
                     num_query_groups=8, ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm")
    C, d, e = 65536, 128, 2
    spec = FPDTSpec(chunk_size=C, offload=True)
    forward, _ = pool_buffers(l8b, spec, cp=16, dtype_bytes=e)
    u = (1 << 24) // C
    assert forward[C * 1 * d * e] == 2 * u  # k and v of each chunk: the one KV head the rank holds (q, o: 2 heads)
    # q, k, v in head layout per local token: 32 query heads and a KV head on each of 32 ranks
    o = ActivationOptions(cp=32, dtype_bytes=e)
    o8 = ActivationOptions(cp=8, dtype_bytes=e)
    grow = long_context_layer_bytes(l8b, o, "ulysses") * 32 - long_context_layer_bytes(l8b, o8, "ulysses") * 8
    assert grow == (1 << 24) * 2 * (32 - 8) * d * e  # k, v for 32 ranks instead of 8 heads
