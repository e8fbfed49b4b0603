"""Distributed-optimizer checkpoints: saved under one layout, resumed under another.

A run saved at iteration 2 and resumed to iteration 4 must give the losses and final
parameters of an uninterrupted single-process run (float32, dropout 0, layout-invariant
initialisation; RTOL covers the reduction order of other layouts) whatever the layout,
schedule and optimizer kind on either side, when the saved format allows it (see
docs/reference/checkpoints.md); otherwise the load fails with one line naming what changed.
One spawned run per world size; later worlds load what earlier ones saved.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import pytest

from harness import run_distributed
from harness.state import max_relative_difference

from harness.weipipe_gpt import RTOL, argv, merge, train

DIST = dict(use_distributed_optimizer=True)
FULL = dict(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
PP2 = dict(pipeline_model_parallel_size=2)
TP2 = dict(tensor_model_parallel_size=2, make_vocab_size_divisible_by=256)  # same padded vocabulary (512)
VPP = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
CP2 = dict(context_parallel_size=2)
FPDT = dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16)


def _ws(schedule):
    return dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule)


# (name, world size, flags, saved checkpoint it loads or None, checkpoint it saves or None)
RUNS = [
    ("dp2-dist-save", 2, DIST, None, "dp2_dist"),
    ("dp2-full-save", 2, FULL, None, "dp2_full"),
    ("dp2-plain-save", 2, {}, None, "dp2_plain"),
    ("dp2-dist<-dp2-dist", 2, DIST, "dp2_dist", None),
    ("dp2-plain<-dp2-full", 2, {}, "dp2_full", None),
    ("dp2-dist<-dp2-plain", 2, DIST, "dp2_plain", None),
    ("dp1-dist<-dp2-dist", 1, DIST, "dp2_dist", None),
    ("dp1-plain<-dp2-full", 1, {}, "dp2_full", None),
    ("dp1-plain<-dp2-dist", 1, {}, "dp2_dist", None),  # error: dp_reshardable into a plain optimizer
    ("dp4-dist<-dp2-dist", 4, DIST, "dp2_dist", None),
    ("1f1b-dp2-dist<-dp2-full", 4, {**PP2, **DIST}, "dp2_full", None),
    ("tp2-dp2-dist<-dp2-full", 4, {**TP2, **DIST}, "dp2_full", None),
    ("1f1b-dp2-dist<-dp2-dist", 4, {**PP2, **DIST}, "dp2_dist", None),  # error: PP changed
    ("vpp-dp2-dist-save", 4, {**VPP, **DIST}, None, "vpp_dist"),
    ("vpp-dp2-dist<-vpp-dp2-dist", 4, {**VPP, **DIST}, "vpp_dist", None),
    ("vpp-dp2-full-save", 4, {**VPP, **FULL}, None, "vpp_full"),
    ("weipipe-zb-dp2-dist<-vpp-full", 4, {**_ws("weipipe-zb"), **DIST}, "vpp_full", None),
    ("weipipe-naive-dp2-full-save", 4, {**_ws("weipipe-naive"), **FULL}, None, "wn_full"),
    ("vpp-dp2-plain<-weipipe-naive-full", 4, {**VPP}, "wn_full", None),
    ("weipipe-interleave-dp2-dist-save", 4, {**_ws("weipipe-interleave"), **DIST}, None, "wi_dist"),
    ("weipipe-interleave-dp2-dist<-itself", 4, {**_ws("weipipe-interleave"), **DIST}, "wi_dist", None),
    ("ulysses-cp2-dp2-full-save", 4, {**CP2, **FULL}, None, "cp2_full"),
    ("fpdt-cp2-dp2-dist<-ulysses-full", 4, {**FPDT, **DIST}, "cp2_full", None),
    ("ulysses-cp2-dp2-dist<-dp2-full", 4, {**CP2, **DIST}, "dp2_full", None),
]
ERRORS = {
    "dp1-plain<-dp2-dist": "loads only into the distributed optimizer",
    "1f1b-dp2-dist<-dp2-dist": "pipeline_model_parallel_size 1 -> 2",
}


def _argv(flags: dict, load: str | None, save: str | None) -> list[str]:
    extra = dict(flags)
    if load:
        extra["load"] = load
    if save:
        extra.update(save=save, exit_interval=2)
    return argv(train_iters=4, log_interval=1, **extra)


def _run_all(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    from megatron.core import parallel_state

    from megatron_weipipe.training.checkpoint.directory import CheckpointError

    out = []
    for a in argvs:
        try:
            out.append(train(rank, world_size, a))
        except CheckpointError as e:
            parallel_state.destroy_model_parallel()
            out.append({"error": str(e)})
    return out


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    root = tempfile.mkdtemp(prefix="ckpt_resharding_")
    results = {}
    reference = run_distributed(_run_all, 1, [_argv({}, None, None)], timeout=300)
    results["reference"] = merge(reference, 0)
    for world in (2, 1, 4):
        runs = [r for r in RUNS if r[1] == world]
        argvs = [_argv(flags, load and os.path.join(root, load), save and os.path.join(root, save))
                 for _, _, flags, load, save in runs]
        per_rank = run_distributed(_run_all, world, argvs, timeout=600)
        for i, (name, *_rest) in enumerate(runs):
            results[name] = {"error": per_rank[0][i]["error"]} if "error" in per_rank[0][i] else merge(per_rank, i)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_resume_across_layouts(name):
    results = _results()
    run, reference = results[name], results["reference"]
    if name in ERRORS:
        assert "error" in run, f"{name}: loaded although the format cannot reshard"
        assert ERRORS[name] in run["error"] and "\n" not in run["error"], run["error"]
        return
    assert "error" not in run, run.get("error")
    saving = name.endswith("-save")
    expected = reference["losses"][:2] if saving else reference["losses"][2:]
    np.testing.assert_allclose(run["losses"], expected, rtol=RTOL, atol=0, err_msg=name)
    if not saving:
        assert "loaded checkpoint" in run["log"], name
        rel, where = max_relative_difference(run["params"], reference["params"])
        assert rel < RTOL, f"{name}: parameter {where} differs by {rel:.2e}"
