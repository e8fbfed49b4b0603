"""FPDT and Ulysses attention against a single-process, unsharded, unchunked reference.

The reference (tests/fpdt_reference.py) splits the fused QKV as megatron-core does, uses
megatron-core's rotary functions and torch SDPA on the whole sequence. Each distributed
run covers many configurations to keep process start-ups few: float64 within 1e-10,
float32 within 1e-5 (relative to the largest reference value, which is O(1) here).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from megatron_weipipe.fpdt import (
    AttentionSpec,
    CommCounter,
    FPDTConfig,
    OffloadStats,
    RotaryConfig,
    fpdt_attention,
    shard,
    ulysses_attention,
)
from fpdt_reference import HEAD_DIM, HIDDEN, make_case, reference_attention, scaled_error
from harness import run_distributed

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference_grads(case, spec):
    leaves = {k: (v.clone().requires_grad_(True) if v is not None else None) for k, v in case.items() if k != "dy"}
    out = reference_attention(leaves["x"], leaves["wq"], leaves["bq"], leaves["wp"], leaves["bp"], spec)
    out.backward(case["dy"])
    grads = {k: v.grad for k, v in leaves.items() if v is not None}
    return out.detach(), grads


def run_case(cfg: dict, cp_group, tp_group=None) -> dict:
    """One configuration on this rank; returns scaled max errors of output and gradients."""
    P = 1 if cp_group is None else dist.get_world_size(cp_group)
    r = 0 if cp_group is None else dist.get_rank(cp_group)
    TP = 1 if tp_group is None else dist.get_world_size(tp_group)
    t = 0 if tp_group is None else dist.get_rank(tp_group)
    heads, groups, S, b, u = cfg["heads"], cfg["groups"], cfg["S"], cfg["b"], cfg["u"]
    dtype = cfg.get("dtype", torch.float64)
    rot = RotaryConfig(base=cfg.get("base", 10000.0), percent=cfg.get("percent", 1.0))
    full = AttentionSpec(HIDDEN, heads, HEAD_DIM, groups, rotary=rot)
    local = AttentionSpec(HIDDEN, heads // TP, HEAD_DIM, groups // TP, rotary=rot)
    case = make_case(S, b, full, cfg["bias"], cfg["seed"])
    ref_out, ref_g = reference_grads(case, full)

    # Megatron TP shards: whole query groups of linear_qkv rows, heads of linear_proj columns.
    qrows = slice(t * local.qkv_size, (t + 1) * local.qkv_size)
    pcols = slice(t * local.proj_input_size, (t + 1) * local.proj_input_size)
    params = {
        "wq": case["wq"][qrows],
        "bq": None if case["bq"] is None else case["bq"][qrows],
        "wp": case["wp"][:, pcols],
        "bp": case["bp"],
    }
    params = {k: (v.to(dtype).requires_grad_(True) if v is not None else None) for k, v in params.items()}
    x = shard(case["x"], P, r, u, dim=0).to(dtype).requires_grad_(True)
    dy = shard(case["dy"], P, r, u, dim=0).to(dtype)
    stats, comm = OffloadStats(), CommCounter()
    if cfg.get("ulysses"):
        out = ulysses_attention(x, params["wq"], params["bq"], params["wp"], params["bp"], local, cp_group, tp_group, counter=comm)
    else:
        fc = FPDTConfig(chunk_size=S // u, offload=cfg["offload"], overlap_comm=cfg.get("overlap", True))
        out = fpdt_attention(
            x, params["wq"], params["bq"], params["wp"], params["bp"], local, fc, cp_group, tp_group, stats=stats, counter=comm
        )
    out.backward(dy)
    res = {
        "out": scaled_error(out.detach(), shard(ref_out, P, r, u, dim=0)),
        "dx": scaled_error(x.grad, shard(ref_g["x"], P, r, u, dim=0)),
    }
    ref_slices = {"wq": ref_g["wq"][qrows], "wp": ref_g["wp"][:, pcols]}
    if case["bq"] is not None:
        ref_slices["bq"] = ref_g["bq"][qrows]
        ref_slices["bp"] = ref_g["bp"]
    for k, ref in ref_slices.items():
        g = params[k].grad.double().clone()
        if cp_group is not None:
            dist.all_reduce(g, group=cp_group)  # weight grads are per-rank shares (DP x CP reduce)
        res[k] = scaled_error(g, ref)
    res["max_resident"] = max(stats.max_resident.values(), default=0)
    res["a2a_bytes"] = comm.bytes_sent
    return res


def _configs(P: int, S: int):
    out = []
    seed = 0
    for u, (h, g), off, b in itertools.product((1, 2, 4, 8), ((4, 4), (8, 4) if P == 4 else (4, 2)), (False, True), (1, 2)):
        seed += 1
        out.append(dict(heads=h, groups=g, S=S, b=b, u=u, offload=off, bias=(seed % 2 == 0), seed=seed, percent=0.5 if off else 1.0))
    return out


def _float32_configs(S: int, gqa: dict):
    return [
        dict(gqa, S=S, b=2, u=4, offload=True, bias=True, seed=101, dtype=torch.float32),
        dict(heads=4, groups=4, S=S, b=1, u=2, offload=False, bias=False, seed=102, dtype=torch.float32),
    ]


def _extra_configs(S: int, gqa: dict):
    return [
        dict(gqa, S=S, b=2, u=1, offload=False, bias=True, seed=201, ulysses=True),
        dict(gqa, S=S, b=2, u=4, offload=True, bias=True, seed=202, overlap=False),
        dict(gqa, S=S, b=1, u=1, offload=False, bias=False, seed=203, base=500000.0),
    ]


def _world_run(rank, world, S):
    group = dist.group.WORLD
    gqa = dict(heads=8, groups=4) if world == 4 else dict(heads=4, groups=2)
    results = {}
    for i, cfg in enumerate(_configs(world, S) + _float32_configs(S, gqa) + _extra_configs(S, gqa)):
        results[i] = (cfg, run_case(cfg, group))
    # Communication volume is independent of the chunk count (same tokens, same heads).
    base = dict(gqa, S=S, b=1, offload=False, bias=False, seed=7)
    results["bytes"] = [run_case(dict(base, u=u), group)["a2a_bytes"] for u in (1, 2, 4)] + [
        run_case(dict(base, u=1, ulysses=True), group)["a2a_bytes"]
    ]
    if world == 4:  # TP=2 x CP=2: groups {0,1},{2,3} for TP and {0,2},{1,3} for CP
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        cp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        tp_cfgs = [
            dict(heads=8, groups=4, S=16, b=2, u=2, offload=True, bias=True, seed=301),
            dict(heads=4, groups=4, S=16, b=1, u=1, offload=False, bias=False, seed=302),
            dict(heads=8, groups=4, S=16, b=2, u=1, offload=False, bias=True, seed=303, ulysses=True),
        ]
        results["tp"] = [(c, run_case(c, cp, tp)) for c in tp_cfgs]
    return results


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world_run, 2, 32, timeout=240)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world_run, 4, 64, timeout=300)


def _check(per_rank, key):
    bad = []
    for rank, res in enumerate(per_rank):
        items = res[key] if isinstance(key, str) else [res[key]]
        for cfg, errs in items:
            tol = TOL[cfg.get("dtype", torch.float64)]
            for name in ("out", "dx", "wq", "bq", "wp", "bp"):
                if name in errs and not errs[name] <= tol:
                    bad.append(f"rank {rank} {name} err {errs[name]:.2e} > {tol:g} for {cfg}")
            if cfg.get("offload") and errs["max_resident"] > 2:
                bad.append(f"rank {rank} held {errs['max_resident']} chunks for {cfg}")
    assert not bad, "\n".join(bad[:10])


def _keys(per_rank):
    return [k for k in per_rank[0] if isinstance(k, int)]


def test_cp2_matches_reference(world2):
    for k in _keys(world2):
        _check(world2, k)


def test_cp4_matches_reference(world4):
    for k in _keys(world4):
        _check(world4, k)


def test_tp2_cp2_matches_reference(world4):
    _check(world4, "tp")


def test_alltoall_bytes_do_not_depend_on_chunks(world2, world4):
    for per_rank in (world2, world4):
        for res in per_rank:
            assert len(set(res["bytes"])) == 1 and res["bytes"][0] > 0, res["bytes"]


def test_offloaded_configs_counted_residency(world2):
    counted = [errs["max_resident"] for cfg, errs in (world2[0][k] for k in _keys(world2)) if cfg.get("offload") and cfg["u"] > 2]
    assert counted and max(counted) == 2  # double buffering is used, and never exceeded


@pytest.mark.parametrize("u", [1, 2, 4, 8])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 1)])
def test_cp1_matches_reference(u, heads, groups):
    for b, off in ((1, False), (2, True)):
        cfg = dict(heads=heads, groups=groups, S=16, b=b, u=u, offload=off, bias=b == 2, seed=u + heads + groups)
        errs = run_case(cfg, None)
        for name in ("out", "dx", "wq", "wp"):
            assert errs[name] <= 1e-10, (name, errs, cfg)


def test_cp1_float32_within_1e5():
    for u in (1, 4):
        errs = run_case(dict(heads=4, groups=2, S=32, b=2, u=u, offload=u > 1, bias=True, seed=5, dtype=torch.float32), None)
        assert max(errs[n] for n in ("out", "dx", "wq", "bq", "wp", "bp")) <= 1e-5, errs


def test_rotary_options_match_megatron():
    for rot in (
        RotaryConfig(base=10000.0, percent=0.5, interleaved=True),
        RotaryConfig(base=500000.0, rope_scaling=True, seq_len_interpolation_factor=2.0),
    ):
        spec = AttentionSpec(HIDDEN, 4, HEAD_DIM, 2, rotary=rot)
        case = make_case(16, 1, spec, True, 9)
        ref_out, ref_g = reference_grads(case, spec)
        x = case["x"].clone().requires_grad_(True)
        out = fpdt_attention(x, case["wq"], case["bq"], case["wp"], case["bp"], spec, FPDTConfig(chunk_size=4))
        out.backward(case["dy"])
        assert scaled_error(out.detach(), ref_out) <= 1e-10 and scaled_error(x.grad, ref_g["x"]) <= 1e-10


def test_no_rotary_and_custom_scale():
    spec = AttentionSpec(HIDDEN, 4, HEAD_DIM, 4, rotary=None, softmax_scale=0.2)
    case = make_case(16, 2, spec, False, 11)
    ref_out, _ = reference_grads(case, spec)
    out = fpdt_attention(case["x"], case["wq"], None, case["wp"], None, spec, FPDTConfig(chunk_size=4, offload=True))
    assert scaled_error(out, ref_out) <= 1e-10


def test_softmax_scale_is_head_dim():
    spec = AttentionSpec(HIDDEN, 4, HEAD_DIM)
    assert spec.scale == pytest.approx(1 / math.sqrt(HEAD_DIM))
