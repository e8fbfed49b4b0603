"""Checkpoints move between 1F1B (PP=2) and WeiPipe (ring of 2) both ways.

The owner of chunk c holds stage c's layers under the same sharded keys; the ring
replicas of embedding / final norm are saved as non-main replicas. A run saved at
iteration 2 under one schedule and resumed under the other (model, Adam state, LR
schedule, data position) continues with the losses and parameters of an uninterrupted
1F1B run.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from harness import run_distributed
from harness.state import max_relative_difference

from harness.weipipe_gpt import RTOL, argv, merge, train_many


def _args(schedule, **extra):
    return argv(pipeline_model_parallel_size=2, pipeline_schedule=schedule, train_iters=4, log_interval=1,
                eval_interval=2, eval_iters=1, **extra)


def _validation_losses(log: str) -> dict[int, float]:
    """{iteration: validation lm loss} from the log."""
    found = re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", log)
    return {int(it): float(v) for it, v in found}


@pytest.mark.distributed
def test_checkpoint_interchange_1f1b_and_weipipe(tmp_path):
    a, b = str(tmp_path / "from_1f1b"), str(tmp_path / "from_weipipe")
    runs = {
        "straight": _args("1f1b"),
        "1f1b-save": _args("1f1b", save=a, exit_interval=2),
        "weipipe-resume": _args("weipipe-interleave", load=a),
        "weipipe-save": _args("weipipe-zb", save=b, exit_interval=2),
        "1f1b-resume": _args("1f1b", load=b),
    }
    per_rank = run_distributed(train_many, 2, list(runs.values()), timeout=400)
    out = {name: merge(per_rank, i) for i, name in enumerate(runs)}
    straight = out["straight"]
    assert len(straight["losses"]) == 4
    for saved, resumed in (("1f1b-save", "weipipe-resume"), ("weipipe-save", "1f1b-resume")):
        np.testing.assert_allclose(out[saved]["losses"], straight["losses"][:2], rtol=RTOL, err_msg=saved)
        assert len(out[resumed]["losses"]) == 2, resumed
        np.testing.assert_allclose(out[resumed]["losses"], straight["losses"][2:], rtol=RTOL, err_msg=resumed)
        for it in (3, 4):
            rel, where = max_relative_difference(out[resumed]["grads"][it], straight["grads"][it])
            assert rel < RTOL, f"{resumed}: iteration {it} gradient of {where} differs by {rel:.2e}"
        rel, where = max_relative_difference(out[resumed]["params"], straight["params"])
        assert rel < RTOL, f"{resumed}: parameter {where} differs by {rel:.2e}"
    assert "loaded checkpoint" in out["weipipe-resume"]["log"]
    # Evaluation (forward only) agrees too, on the same validation samples.
    valid = _validation_losses(straight["log"])
    assert sorted(valid) == [2, 4]
    for name, its in (("1f1b-save", [2]), ("weipipe-save", [2]), ("weipipe-resume", [4]), ("1f1b-resume", [4])):
        got = _validation_losses(out[name]["log"])
        assert sorted(got) == its, (name, got)
        for it in its:
            assert abs(got[it] - valid[it]) <= RTOL * abs(valid[it]), (name, it, got[it], valid[it])
    # The log line names what each schedule moves.
    assert "activations=" in straight["log"] and "weights=" not in straight["log"]
    assert "weights=" in out["weipipe-resume"]["log"] and "gradients=" in out["weipipe-resume"]["log"]
