"""Resume: 20 iterations straight equal 10 + save + load + 10, losses bit-for-bit in float32."""

import os

import numpy as np

from harness import run_distributed
from harness.runs import tiny_gpt_args, train_and_collect


def _straight_then_split(rank, world_size, ckpt_dir):
    common = dict(pipeline_model_parallel_size=2, train_iters=20, hidden_dropout=0.1, lr_warmup_iters=3)
    straight = train_and_collect(rank, world_size, tiny_gpt_args(**common), collect_grads=False)
    first = train_and_collect(
        rank, world_size, tiny_gpt_args(**common, save=ckpt_dir, save_interval=10, exit_interval=10),
        collect_grads=False,
    )
    second = train_and_collect(
        rank, world_size, tiny_gpt_args(**common, save=ckpt_dir, load=ckpt_dir, save_interval=10), collect_grads=False
    )
    return straight["losses"], first["losses"], second["losses"], first["iteration"], second["iteration"]


def test_resume_matches_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = run_distributed(_straight_then_split, 2, ckpt, timeout=400)
    straight, first, second, first_iter, second_iter = out[-1]
    assert first_iter == 10 and second_iter == 20
    assert len(first) == 10 and len(second) == 10
    # Dropout on: the RNG state and the data position must both be restored exactly.
    np.testing.assert_array_equal(np.array(first + second), np.array(straight))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "20"
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]
