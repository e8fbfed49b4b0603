"""bf16 (fp32 master weights) trains under every schedule and tracks the float32 run."""

import numpy as np

from harness import run_distributed
from harness.runs import tiny_gpt_args, train_and_collect


def _run_many(rank, world_size, argvs):
    return [train_and_collect(rank, world_size, argv, collect_grads=False)["losses"] for argv in argvs]


def test_bf16_follows_fp32_under_each_schedule():
    common = dict(train_iters=4, make_vocab_size_divisible_by=512)  # learned absolute positions (default)
    fp32 = run_distributed(_run_many, 1, [tiny_gpt_args(**common)], timeout=300)[0][0]
    argvs = [
        tiny_gpt_args(**common, bf16=True, pipeline_model_parallel_size=2),
        tiny_gpt_args(**common, bf16=True, pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave"),
    ]
    runs = run_distributed(_run_many, 2, argvs, timeout=400)[-1]
    for losses in runs:
        assert np.all(np.isfinite(losses))
        np.testing.assert_allclose(losses, fp32, rtol=2e-2)
        assert losses[-1] < losses[0]
