"""Megatron-LM's sample-based training and decoupled learning rate.

--train-samples: the run is --train-samples // --global-batch-size iterations and its
learning rate, iteration by iteration, is megatron-core's OptimizerParamScheduler driven
as Megatron-LM's get_optimizer_param_scheduler drives it. --decoupled-lr: under every
schedule the embedding and output layer sit in parameter groups of their own learning rate,
and one SGD step moves them by exactly that rate times their gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import run_distributed
from harness.runs import tiny_gpt_args

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError

LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR = 1e-3, 1e-4, 7e-3, 2e-4
SAMPLES = dict(train_iters=None, train_samples=44, lr=LR, min_lr=MIN_LR, log_interval=1)  # gbs 8: 5 iterations
ONE_SGD_STEP = dict(train_iters=1, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, lr=LR,
                    lr_decay_style="constant", decoupled_lr=DECOUPLED_LR)
LAYOUTS = {
    "none-dp2": dict(untie_embeddings_and_output_weights=True),
    "1f1b-pp2": dict(pipeline_model_parallel_size=2),
    "interleaved-pp2": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    "weipipe-naive-pp2": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-naive",
                              untie_embeddings_and_output_weights=True),
    "weipipe-zb-pp2-tied": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb"),
    "fsdp2-dp2": dict(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True),
}
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


class _Groups:
    """What OptimizerParamScheduler touches of an optimizer."""

    def __init__(self, *groups: dict):
        self.param_groups = [{}, *groups]


def _megatron_lm_scheduler(train_samples, lr_decay_samples=None, lr_warmup_samples=0, lr_warmup_fraction=None,
                           lr_decay_style="cosine", groups=()):
    """megatron-core's scheduler as Megatron-LM's get_optimizer_param_scheduler builds it for
    sample-based training (lr_warmup_init 0, constant weight decay); ``groups``: more parameter
    groups than the default one (their max_lr/min_lr)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = train_samples if lr_decay_samples is None else lr_decay_samples
    warmup = lr_warmup_fraction * decay if lr_warmup_fraction is not None else lr_warmup_samples
    optimizer = _Groups(*groups)
    return optimizer, OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=lr_decay_style, start_wd=0.01, end_wd=0.01, wd_incr_steps=train_samples,
        wd_incr_style="constant")


def _lrs(optimizer, scheduler, iterations: int, global_batch_size: int) -> list[float]:
    """The learning rate after each iteration's scheduler step (what the log line shows)."""
    out = []
    for _ in range(iterations):
        scheduler.step(increment=global_batch_size)
        out.append(optimizer.param_groups[0]["lr"])
    return out


SCHEDULES = {
    "warmup-and-decay-samples": dict(lr_warmup_samples=12, lr_decay_samples=36),
    "warmup-fraction-of-train-samples": dict(lr_warmup_fraction=0.25, lr_decay_style="linear"),
    "inverse-square-root": dict(lr_warmup_samples=8, lr_decay_style="inverse-square-root"),
}
SAMPLE_RUN = SCHEDULES["warmup-and-decay-samples"]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_sample_based_schedule_is_megatron_lms(name):
    from megatron_weipipe.training.optimizer import build_scheduler

    flags = SCHEDULES[name]
    cfg = parse_config(tiny_gpt_args(**SAMPLES, **flags))
    assert cfg.training.iterations == 44 // 8
    ours = _Groups()
    ours_lrs = _lrs(ours, build_scheduler(cfg, ours), 8, 8)  # past the run's end: the decay's tail too
    assert ours_lrs == _lrs(*_megatron_lm_scheduler(44, **flags), 8, 8)


@pytest.mark.parametrize("flags, line", [
    (dict(train_samples=44), "--train-iters and --train-samples cannot both be given"),
    (dict(train_iters=None), "give --train-iters or --train-samples"),
    (dict(lr_warmup_samples=8), "--lr-warmup-samples needs --train-samples"),
    (dict(train_iters=None, train_samples=44, lr_decay_iters=3), "--lr-decay-iters cannot be combined with"),
])
def test_mixing_iteration_and_sample_flags_is_refused_in_one_line(flags, line):
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args(**flags))
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


# --- trained runs: one spawn of two ranks for every layout -------------------------------------


def _decoupled(param) -> bool:
    """megatron-core's mark of the embedding and output-layer weights."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


def _local_tensors(model_chunks, what: str) -> dict[str, np.ndarray]:
    """This rank's own part of every parameter (an FSDP2 shard, a pipeline stage's, a ring
    rank's) or of its reduced gradient: one SGD step is elementwise, so no assembling."""
    out = {}
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            t = p if what == "param" else getattr(p, "main_grad", None)
            t = p.grad if t is None and what == "grad" else t
            if t is not None:
                t = t.to_local() if hasattr(t, "to_local") else t
                out[f"{i}:{name}"] = t.detach().float().cpu().numpy().copy()
    return out


def _train_one(rank: int, world_size: int, argv: list[str]) -> dict:
    """One run: its optimizer's parameter groups, the logged learning rates, and this rank's
    parameters and reduced gradients before the first optimizer step and parameters at the end."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training import run_setup
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    seen: dict = {}
    lrs: list[float] = []
    build = run_setup.build_optimizer

    def keep_optimizer(cfg, chunks, *args, **kwargs):
        seen["optimizer"] = build(cfg, chunks, *args, **kwargs)
        return seen["optimizer"]

    def before_step(iteration, schedule):
        seen.setdefault("group_lrs", []).append(  # the rates this iteration's step uses
            {bool(g["params"]) and _decoupled(g["params"][0]): g["lr"] for g in seen["optimizer"].param_groups})
        if iteration == 1:
            seen.update(schedule=schedule, before=_local_tensors(schedule.model_chunks, "param"),
                        grads=_local_tensors(schedule.model_chunks, "grad"))

    run_setup.build_optimizer = keep_optimizer
    try:
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=before_step,
                         on_log=lambda stats: lrs.append(stats["lr"]))
    finally:
        run_setup.build_optimizer = build
    chunks = seen["schedule"].model_chunks
    result = dict(
        iteration=state.iteration, lrs=lrs, group_lrs=seen["group_lrs"],
        groups=[(g["lr"], [_decoupled(p) for p in g["params"]]) for g in seen["optimizer"].param_groups],
        marked={f"{i}:{n}" for i, c in enumerate(chunks) for n, p in c.named_parameters() if _decoupled(p)},
        before=seen["before"], grads=seen["grads"], after=_local_tensors(chunks, "param"))
    parallel_state.destroy_model_parallel()
    return result


def _train_all(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    return [_train_one(rank, world_size, argv) for argv in argvs]


@pytest.fixture(scope="module")
def runs():
    names = sorted(LAYOUTS)
    argvs = [tiny_gpt_args(**ONE_SGD_STEP, **LAYOUTS[n]) for n in names]
    argvs.append(tiny_gpt_args(**SAMPLES, **SAMPLE_RUN, decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_MIN_LR))
    per_rank = run_distributed(_train_all, 2, argvs, timeout=900)
    out = {n: [r[i] for r in per_rank] for i, n in enumerate(names)}
    out["samples"] = [r[-1] for r in per_rank]
    return out


def test_sample_based_run_trains_samples_over_global_batch_at_megatron_lms_rates(runs):
    rank0 = runs["samples"][0]
    assert rank0["iteration"] == 44 // 8
    assert rank0["lrs"] == _lrs(*_megatron_lm_scheduler(44, **SAMPLE_RUN), 44 // 8, 8)
    # --decoupled-lr/--decoupled-min-lr: the embedding and output layer's group, same schedule, own bounds
    optimizer, scheduler = _megatron_lm_scheduler(
        44, **SAMPLE_RUN, groups=[{"max_lr": DECOUPLED_LR, "min_lr": DECOUPLED_MIN_LR}])
    expected = []
    for _ in range(44 // 8):  # the rates each iteration's optimizer step uses
        expected.append([g["lr"] for g in optimizer.param_groups])
        scheduler.step(increment=8)
    for rank in runs["samples"]:
        assert [[lrs[False], lrs[True]] for lrs in rank["group_lrs"]] == expected


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decoupled_lr_is_the_embedding_and_output_groups_rate(layout, runs):
    marked_groups = 0
    for rank in runs[layout]:
        for lr, marks in rank["groups"]:
            assert len(set(marks)) <= 1, "a parameter group mixes embedding/output and other weights"
            marked = bool(marks) and marks[0]
            marked_groups += marked
            assert lr == (DECOUPLED_LR if marked else LR)
    assert marked_groups > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_sgd_step_moves_the_embedding_by_the_decoupled_lr(layout, runs):
    for rank in runs[layout]:
        before, grads, after, marked = rank["before"], rank["grads"], rank["after"], rank["marked"]
        assert set(after) == set(before) == set(grads)
        assert marked == {k for k in after if k.endswith(EMBEDDING_OR_OUTPUT)}
        for key in after:
            lr = DECOUPLED_LR if key in marked else LR
            expected = torch.add(torch.from_numpy(before[key]), torch.from_numpy(grads[key]), alpha=-lr)
            np.testing.assert_array_equal(after[key], expected.numpy(), err_msg=f"{layout}: {key}")
    assert any(rank["marked"] for rank in runs[layout])
