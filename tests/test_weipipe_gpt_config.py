"""Every configuration WeiPipe cannot run stops `python pretrain_gpt.py` with one line
on stderr and a non-zero exit code, before any process group exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.runs import REPO_ROOT, tiny_gpt_args

CASES = {
    "ring of one": (2, dict(pipeline_schedule="weipipe-zb"), "--pipeline-model-parallel-size >= 2"),
    "microbatches": (2, dict(pipeline_schedule="weipipe-interleave", pipeline_model_parallel_size=2,
                             global_batch_size=6), "to be a multiple of --pipeline-model-parallel-size (2)"),
    "virtual stages": (2, dict(pipeline_schedule="weipipe-naive", pipeline_model_parallel_size=2,
                               num_layers_per_virtual_pipeline_stage=1), "--num-layers-per-virtual-pipeline-stage"),
    "micro-batches with context parallelism": (4, dict(pipeline_schedule="weipipe-zb", pipeline_model_parallel_size=2,
                                                      context_parallel_size=2, global_batch_size=6),
                                               "to be a multiple of --pipeline-model-parallel-size (2)"),
    "layers": (2, dict(pipeline_schedule="weipipe-zb", pipeline_model_parallel_size=2, num_layers=5),
               "--num-layers (5) must be divisible by --pipeline-model-parallel-size (2)"),
}


@pytest.fixture(scope="module")
def outcomes():
    """All cases at once (each is mostly interpreter start-up)."""
    procs = {}
    for name, (world, flags, _) in CASES.items():
        env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", OMP_NUM_THREADS="1")
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *tiny_gpt_args(**flags)],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=240)
            out[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_bad_configuration_is_one_line(case, outcomes):
    rc, stdout, stderr = outcomes[case]
    lines = stderr.strip().splitlines()
    assert rc != 0
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and CASES[case][2] in lines[0], lines[0]
