"""GPT training in spawned ranks for the parity, checkpoint and overlap tests: brings back
losses, reduced gradients per iteration, final parameters, bytes and the log text."""

from __future__ import annotations

import contextlib
import io

from megatron_weipipe.schedules.registry import weipipe_names
from harness.runs import tiny_gpt_args
from harness.state import assemble, max_relative_difference

WEIPIPE = weipipe_names()
RTOL = 1e-5


def argv(**overrides) -> list[str]:
    # Adam eps 1e-6: the key bias gets only rounding noise as gradient (softmax ignores it),
    # which the default 1e-8 scales up to updates that differ per layout by ~1e-5.
    base = dict(make_vocab_size_divisible_by=512, adam_eps=1e-6)
    base.update(overrides)
    return tiny_gpt_args(**base)


def train(rank: int, world_size: int, args: list[str]) -> dict:
    """pretrain() on this rank; grads as the optimizer will see them, bytes per iteration."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from harness.state import local_shards
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(args, world_size=world_size)
    grads, sent, seen, wgrad = {}, {}, {}, {}

    def after_backward(iteration, schedule):
        seen["schedule"] = schedule
        grads[iteration] = local_shards(schedule.model_chunks, "grad")
        sent[iteration] = dict(schedule.ctx.bytes.snapshot()["sent"])
        seen["chunk_numel"] = getattr(getattr(schedule, "layout", None), "numel", None)
        last = getattr(schedule, "last_iteration", None)
        if last is not None:  # WeiPipe: deferred weight GEMMs and the bytes they kept
            wgrad[iteration] = (last.wgrad_deferred, last.wgrad_peak_bytes, len(schedule.deferrable))

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=after_backward)
    out = {
        "losses": state.losses,
        "grads": grads,
        "params": local_shards(seen["schedule"].model_chunks, "param") if seen else {},
        "sent": sent,
        "chunk_numel": seen.get("chunk_numel"),
        "log": log.getvalue(),
        "wgrad": wgrad,
    }
    parallel_state.destroy_model_parallel()
    return out


def train_many(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    return [train(rank, world_size, a) for a in argvs]


def merge(per_rank: list[list[dict]], index: int) -> dict:
    runs = [r[index] for r in per_rank]
    return {
        "losses": runs[0]["losses"],
        "loss_sets": [r["losses"] for r in runs],
        "grads": {it: assemble(r["grads"][it] for r in runs) for it in runs[0]["grads"]},
        "params": assemble(r["params"] for r in runs),
        "sent": [r["sent"] for r in runs],
        "chunk_numel": [r["chunk_numel"] for r in runs],
        "log": runs[0]["log"],
        "wgrad": [r["wgrad"] for r in runs],
    }


def assert_matches(run: dict, reference: dict, label: str, rtol: float = RTOL) -> None:
    """Losses, every reduced gradient of every iteration and the final parameters."""
    import numpy as np

    ref_losses = np.array(reference["losses"])
    for losses in run["loss_sets"]:
        np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=0, err_msg=label)
    assert set(run["grads"]) == set(reference["grads"]), label
    for it, ref_grads in reference["grads"].items():
        rel, where = max_relative_difference(run["grads"][it], ref_grads)
        assert rel < rtol, f"{label}: iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(run["params"], reference["params"])
    assert rel < rtol, f"{label}: parameter {where} differs by {rel:.2e} after {len(ref_losses)} steps"
