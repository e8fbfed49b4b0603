"""FPDT and Ulysses attention over packed documents against a dense-mask reference.

The reference (tests/fpdt_reference.py) is torch SDPA on the whole sequence with the
[s, s] mask megatron-core's dataset builds from EOD tokens (``_get_ltor_masks_and_
position_ids``). The runs get only document offsets. Documents include one-token ones
and ones crossing chunk and context-parallel boundaries; float64 within 1e-10, the
float32 flash path within 1e-5, output and every gradient. Blocks that a document
boundary cuts run both ways: one varlen call over their document rectangles, and with a
block mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, OffloadStats, RotaryConfig, fpdt_attention, shard, ulysses_attention
from megatron_weipipe.fpdt import packed
from megatron_weipipe.fpdt.documents import Documents, as_documents, document_offsets
from fpdt_reference import HEAD_DIM, HIDDEN, make_case, reference_attention, scaled_error
from harness import run_distributed

S = 32
EOD = 7
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
LAYOUTS = {
    # S = 32; with CP = 2 and 8 chunks the pieces are 2 tokens, chunks 4.
    "mixed": [[1, 3, 1, 1, 6, 13, 1, 6], [9, 1, 22]],
    "one-doc": [[32], [32]],
    "singletons": [[1] * 32, [2] * 16],
}


def tokens_for(lengths: list[list[int]]) -> torch.Tensor:
    """Token rows whose EOD tokens close documents of the given lengths."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for row in lengths:
        assert sum(row) == S
        t = torch.randint(10, 50, (S,), generator=gen)
        t[torch.tensor(row).cumsum(0)[:-1] - 1] = EOD
        rows.append(t)
    return torch.stack(rows)


def dense_mask(tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's own [b, 1, S, S] mask (True = may attend)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return torch.stack([~_get_ltor_masks_and_position_ids(r, EOD, False, True, False, True)[0] for r in tokens])


def run_case(cfg: dict, group) -> dict:
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    u, dtype = cfg["u"], cfg.get("dtype", torch.float64)
    packed.PAD_RATIO = cfg.get("pad_ratio", 1.0)  # inf: masked blocks always one varlen call, 0: block mask
    spec = AttentionSpec(HIDDEN, 4, HEAD_DIM, 2, rotary=RotaryConfig())
    tokens = tokens_for(LAYOUTS[cfg["layout"]])
    case = make_case(S, 2, spec, True, cfg["seed"])
    leaves = {k: v.clone().requires_grad_(True) for k, v in case.items() if k != "dy"}
    ref = reference_attention(leaves["x"], leaves["wq"], leaves["bq"], leaves["wp"], leaves["bp"], spec,
                              attn_mask=dense_mask(tokens))
    ref.backward(case["dy"])
    params = {k: case[k].to(dtype).requires_grad_(True) for k in ("wq", "bq", "wp", "bp")}
    x = shard(case["x"], P, r, u, dim=0).to(dtype).requires_grad_(True)
    docs = Documents(document_offsets(tokens, EOD))
    stats = OffloadStats()
    w = (params["wq"], params["bq"], params["wp"], params["bp"], spec)
    if cfg.get("tile"):
        out = ulysses_attention(x, *w, group, documents=docs, doc_tile=cfg["tile"])
    else:
        fc = FPDTConfig(chunk_size=S // u, offload=cfg.get("offload", False))
        out = fpdt_attention(x, *w, fc, group, stats=stats, documents=docs)
    out.backward(shard(case["dy"], P, r, u, dim=0).to(dtype))
    errs = {"out": scaled_error(out.detach(), shard(ref.detach(), P, r, u, dim=0)),
            "dx": scaled_error(x.grad, shard(leaves["x"].grad, P, r, u, dim=0))}
    for k, p in params.items():
        g = p.grad.double().clone()
        dist.all_reduce(g, group=group)  # per-rank shares of the weight gradients
        errs[k] = scaled_error(g, leaves[k].grad)
    return {"errs": errs, "counts": dict(docs.counts), "fetches": stats.fetches}


CONFIGS = (
    [dict(layout=lay, u=u, offload=off, seed=i) for i, (lay, u, off) in enumerate(
        (lay, u, off) for lay in LAYOUTS for u, off in ((1, False), (4, False), (8, False), (8, True)))]
    + [dict(layout="mixed", u=1, tile=t, seed=50 + t) for t in (4, 32)]
    + [dict(layout="singletons", u=1, tile=8, seed=60)]
    + [dict(layout=lay, u=u, offload=u == 8, seed=70 + u, pad_ratio=float("inf")) for lay in ("mixed", "singletons") for u in (2, 8)]
    + [dict(layout="mixed", u=1, tile=8, seed=80, pad_ratio=float("inf"))]
    + [dict(layout="mixed", u=4, offload=True, seed=90, dtype=torch.float32),
       dict(layout="mixed", u=1, tile=8, seed=91, dtype=torch.float32),
       dict(layout="mixed", u=4, seed=92, dtype=torch.float32, pad_ratio=float("inf"))]
)


def _world_run(rank, world):
    return [run_case(c, dist.group.WORLD) for c in CONFIGS]


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_world_run, 2, timeout=300)


def test_cp2_matches_dense_reference(cp2):
    worst = {}
    for rank_results in cp2:
        for cfg, res in zip(CONFIGS, rank_results):
            dtype = cfg.get("dtype", torch.float64)
            assert max(res["errs"].values()) < TOL[dtype], (cfg, res["errs"])
            worst[dtype] = max(worst.get(dtype, 0.0), *res["errs"].values())
    print("max scaled error:", {str(k): f"{v:.1e}" for k, v in worst.items()})


def test_every_block_kind_and_skipping_occur(cp2):
    kinds = set()
    for res in cp2[0]:
        kinds |= set(res["counts"])
    assert kinds == {"skip", "full", "causal", "masked"}
    by = {(c["layout"], c["u"], c.get("offload"), c.get("tile")): res for c, res in zip(CONFIGS, cp2[0])
          if "pad_ratio" not in c}
    # One-token documents: every earlier chunk is skipped, so nothing is fetched back.
    assert by[("singletons", 8, True, None)]["counts"] == {"masked": 8, "skip": 28}
    assert by[("singletons", 8, True, None)]["fetches"] < by[("one-doc", 8, True, None)]["fetches"]
    assert by[("one-doc", 8, True, None)]["counts"] == {"causal": 8, "full": 28}


def test_offsets_match_megatron_dense_mask():
    tokens = tokens_for(LAYOUTS["mixed"])
    docs = Documents(document_offsets(tokens, EOD))
    assert docs.lengths() == LAYOUTS["mixed"]
    assert torch.equal(docs.visible(0, S, 0, S), dense_mask(tokens)[:, 0])
    assert document_offsets(torch.full((1, 4), EOD), EOD).tolist() == [[0, 1, 2, 3, 4]]
    assert document_offsets(torch.zeros(1, 4, dtype=torch.long), EOD).tolist() == [[0, 4]]


def test_dense_mask_is_refused():
    with pytest.raises(ValueError, match="not a dense attention mask"):
        as_documents(torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="never decrease"):
        Documents(torch.tensor([[0, 3, 2, 4]]))
