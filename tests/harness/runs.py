"""Train small models inside spawned ranks and bring back what tests compare."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_DATA = os.path.join(REPO_ROOT, "data", "sample_text_document")


def tiny_gpt_args(**overrides) -> list[str]:
    """Flags for a small float32 GPT on the sample corpus with dropout off (exact comparisons)."""
    flags = {
        "num-layers": 4,
        "hidden-size": 32,
        "num-attention-heads": 4,
        "seq-length": 32,
        "micro-batch-size": 2,
        "global-batch-size": 8,
        "train-iters": 3,
        "lr": 1e-3,
        "hidden-dropout": 0.0,
        "attention-dropout": 0.0,
        "data-path": SAMPLE_DATA,
        "tokenizer-type": "ByteLevelTokenizer",
        "log-interval": 1000,
        "eval-iters": 0,
        "seed": 1234,
    }
    switches = []
    for k, v in overrides.items():
        k = k.replace("_", "-")
        if v is True:
            switches.append(f"--{k}")
        elif v is None or v is False:
            flags.pop(k, None)
        else:
            flags[k] = v
    out = []
    for k, v in flags.items():
        out += [f"--{k}", str(v)]
    return out + switches


def train_and_collect(rank: int, world_size: int, argv: list[str], collect_grads: bool = True) -> dict:
    """Run pretrain() on this rank; return losses, per-iteration gradient shards and final params."""
    import pretrain_gpt
    from megatron_weipipe.arguments import parse_config
    from megatron.core import parallel_state
    from megatron_weipipe.model.gpt_step import forward_step
    from harness.state import local_shards
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    grads: dict[int, dict] = {}
    seen: dict = {}

    def after_backward(iteration, schedule):
        seen["schedule"] = schedule
        if collect_grads:
            grads[iteration] = local_shards(schedule.model_chunks, "grad")

    state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=after_backward)
    result = {
        "losses": state.losses,
        "grad_norms": state.grad_norms,
        "grads": grads,
        "params": local_shards(seen["schedule"].model_chunks, "param") if seen else {},
        "iteration": state.iteration,
    }
    parallel_state.destroy_model_parallel()  # keep the default group for the next run
    return result



def train_many(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """Several runs, one after another, in the same ranks (one spawn for a table of runs)."""
    return [train_and_collect(rank, world_size, argv) for argv in argvs]


def merge_ranks(per_rank: list[list[dict]], index: int) -> dict:
    """Run ``index`` of train_many as one model: losses and grad norms of rank 0 (every rank's
    losses in ``loss_sets``), gradients and parameters assembled from every rank's shards."""
    from harness.state import assemble

    runs = [r[index] for r in per_rank]
    return {
        "losses": runs[0]["losses"],
        "grad_norms": runs[0]["grad_norms"],
        "loss_sets": [r["losses"] for r in runs],
        "grads": {it: assemble(r["grads"][it] for r in runs) for it in runs[0]["grads"]},
        "params": assemble(r["params"] for r in runs),
    }
