"""Megatron-LM's data-parallel, pipeline-communication and memory-housekeeping flags do here
what they do there, through megatron-core:

* ``--overlap-param-gather``: at DP=4 (schedule none) and DP=2 x PP=2 (1f1b, interleaved)
  the losses, validation losses and every rank's parameters are bitwise those of the run
  without it, across an evaluation and a checkpoint saved mid-run and resumed; and the
  all-gather really moved: none inside the optimizer step (without the flag every step
  gathers synchronously), each started asynchronously in the next forward and waited for
  by a forward pre-hook.
* ``--overlap-p2p-comm``: interleaved 1F1B with the flag has the same losses and gradients,
  and its point-to-point exchanges were left in flight (none without it).
* ``--num-distributed-optimizer-instances 2`` at DP=4: the losses and parameters of the
  one-process run (rtol 1e-6), each rank holding half the Adam state, equal to the same
  half on the other instance (at N=1 a quarter), and a checkpoint that resumes bitwise;
  weipipe-zb at DP=2 x PP=2 with two instances matches the one-process run too (1e-5).
* ``--manual-gc`` (``--manual-gc-interval``, ``--no-manual-gc-eval``): automatic collection
  off while training, collections at the start, at the interval and around evaluation
  (seen by gc.callbacks), switched back on afterwards.
* ``--empty-unused-memory-level``: the platform's empty_cache counted, 1: after each
  forward/backward and evaluation step, 2: also after each optimizer step.

Two spawns: four ranks for the data-parallel runs, one process for the reference and the
housekeeping runs.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from harness import run_distributed
from harness.runs import tiny_gpt_args
from harness.state import assemble, max_relative_difference
from harness.weipipe_gpt import RTOL as WEIPIPE_RTOL

ITERS, SAVE_AT = 3, 2
DIST_OPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)
# every run: one evaluation of one batch, after iteration 3; the checkpoints of iteration 2
# are saved right after a step, with the gather of what it updated still to come
EVAL = dict(train_iters=ITERS, eval_interval=3, eval_iters=1)
# DP=2 x PP=2 with four microbatches per replica: the interleaved schedule reaches its steady
# state, where it overlaps point-to-point communication (with two it only warms up and cools down)
PP2 = dict(pipeline_model_parallel_size=2, micro_batch_size=1)
VPP = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, micro_batch_size=1)
# The partial distributed optimizer is compared with one process: its reductions sum in
# another order, and Adam's default eps turns the key bias's rounding-noise gradient into
# updates that differ by ~1e-5 (tests/test_foundation_parity.py); 1e-6 keeps them at rounding.
CLOSE = dict(adam_eps=1e-6)
RTOL = 1e-6


def _runs4(tmp: str) -> list:
    """(name, flags, options) of the four-rank runs, in order."""
    opg = dict(overlap_param_gather=True)
    save = dict(save=os.path.join(tmp, "opg"), save_interval=SAVE_AT)
    partial = dict(num_distributed_optimizer_instances=2, **CLOSE)
    return [
        ("none", dict(**DIST_OPT, **EVAL), {"gathers": True, "optimizer": True}),
        ("none+opg", dict(**DIST_OPT, **EVAL, **opg, **save), {"gathers": True}),
        ("none+opg resumed", dict(**DIST_OPT, **EVAL, **opg, load=save["save"]), {"resume": save["save"]}),
        ("1f1b", dict(**DIST_OPT, **EVAL, **PP2), {}),
        ("1f1b+opg", dict(**DIST_OPT, **EVAL, **PP2, **opg), {"gathers": True}),
        ("interleaved", dict(**DIST_OPT, **EVAL, **VPP), {"p2p": True, "grads": True}),
        ("interleaved+opg", dict(**DIST_OPT, **EVAL, **VPP, **opg), {"gathers": True}),
        ("interleaved+p2p", dict(**DIST_OPT, **EVAL, **VPP, overlap_p2p_comm=True), {"p2p": True, "grads": True}),
        ("partial", dict(**DIST_OPT, **EVAL, **partial, save=os.path.join(tmp, "partial"), save_interval=SAVE_AT),
         {"optimizer": True}),
        ("partial resumed", dict(**DIST_OPT, **EVAL, **partial, load=os.path.join(tmp, "partial")),
         {"resume": os.path.join(tmp, "partial")}),
        ("weipipe partial", dict(**DIST_OPT, **EVAL, **partial, pipeline_model_parallel_size=2,
                                 pipeline_schedule="weipipe-zb"), {}),
    ]


def _train(rank: int, world: int, runs: list) -> dict:
    """Every run in turn on this rank, with the probes its options ask for."""
    import torch.distributed as dist
    from harness import ddp_probes as probes
    from harness.runs import train_and_collect

    out = {}
    for name, flags, opts in runs:
        if "resume" in opts:  # resume from the mid-run checkpoint, not the last one
            if rank == 0:
                with open(os.path.join(opts["resume"], "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(SAVE_AT))
            dist.barrier()
        events, validation, optimizers = [], [], []
        with contextlib.ExitStack() as stack:
            stack.enter_context(probes.record_validation(validation))
            stack.enter_context(probes.capture_optimizer(optimizers))
            if opts.get("gathers"):
                stack.enter_context(probes.record_param_gathers(events))
            if opts.get("p2p"):
                stack.enter_context(probes.record_p2p(events))
            result = train_and_collect(rank, world, tiny_gpt_args(**flags), collect_grads=opts.get("grads", False))
        result.update(events=events, validation=validation)
        if opts.get("optimizer"):
            result["optimizer"] = probes.optimizer_shard(optimizers[0])
        out[name] = result
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ddp_options"))
    return run_distributed(_train, 4, _runs4(tmp), timeout=600)


def _same(a: dict, b: dict) -> None:
    """Bitwise: the same tensors with the same values."""
    assert set(a) == set(b)
    for k in a:
        assert len(a[k]) == len(b[k]), k
        for (shape_a, off_a, x), (shape_b, off_b, y) in zip(a[k], b[k]):
            assert (shape_a, off_a) == (shape_b, off_b), k
            assert np.array_equal(x, y), f"{k} differs by {np.abs(x - y).max():.3e}"


def _per_iteration(events: list) -> list[list]:
    """The events of each training iteration (from its forward to the next one's)."""
    out = []
    for e in events:
        if e == ("forward", False):
            out.append([])
        if out:
            out[-1].append(e)
    return out


@pytest.mark.parametrize("schedule", ["none", "1f1b", "interleaved"])
def test_overlap_param_gather_is_bitwise_the_same_run(world4, schedule):
    for rank in world4:  # rank by rank: every rank's whole parameters
        a, b = rank[schedule], rank[f"{schedule}+opg"]
        assert a["losses"] == b["losses"] and len(a["losses"]) == ITERS
        assert a["validation"] == b["validation"] and len(a["validation"]) == 1
        _same(a["params"], b["params"])


def test_overlap_param_gather_defers_the_gather_into_the_next_forward(world4):
    for name, rank in [(name, rank) for name in ("none", "none+opg", "1f1b+opg", "interleaved+opg")
                       for rank in range(len(world4))]:
        events = world4[rank][name]["events"]
        steps = [i for i, e in enumerate(events) if e == ("step",)]
        assert len(steps) == ITERS, name
        inside = [e for s in steps for e in events[s:events.index(("stepped",), s)] if e[0] == "gather"]
        if name == "none":  # the control: every step gathers, synchronously
            assert inside and all(not asynchronous for _, asynchronous in inside), inside
            continue
        assert not inside, f"{name}: the optimizer step gathered {inside}"
        first, second = [it[:it.index(("step",))] for it in _per_iteration(events)[:2]]
        # iteration 1 runs with the hooks off (Megatron-LM); iteration 2 gathers what step 1
        # updated, each bucket group started asynchronously and waited for by a pre-hook
        assert not [e for e in first if e[0] == "gather"], (name, first)
        gathers = [e for e in second if e[0] == "gather"]
        assert gathers and all(asynchronous for _, asynchronous in gathers), (name, second)
        assert second.count(("wait",)) == len(gathers), (name, second)


def test_overlap_param_gather_checkpoint_resumes_bitwise(world4):
    for rank in world4:
        full, resumed = rank["none+opg"], rank["none+opg resumed"]
        assert resumed["losses"] == full["losses"][SAVE_AT:]
        _same(resumed["params"], full["params"])


def test_overlap_p2p_comm_keeps_losses_and_gradients(world4):
    for rank in world4:
        a, b = rank["interleaved"], rank["interleaved+p2p"]
        assert a["losses"] == b["losses"] and a["validation"] == b["validation"]
        for it in a["grads"]:
            _same(a["grads"][it], b["grads"][it])
        _same(a["params"], b["params"])
        assert a["events"] and ("p2p", False) not in a["events"]  # the control: every exchange waited
        assert ("p2p", False) in b["events"], b["events"]


# --------------------------------------------------------------------------- one process


def _one_process(rank: int, world: int, runs: list) -> dict:
    """The reference run and the housekeeping runs, observed from inside the process."""
    import gc

    from harness import ddp_probes as probes
    from harness.runs import train_and_collect

    from megatron_weipipe.platform import Platform

    out = {}
    for name, flags in runs:
        validation = []
        seen = {"collections": [], "gc_enabled": [], "empty_cache": 0, "iteration": None}

        def collected(phase, info):
            if phase == "start":
                seen["collections"].append((info["generation"], seen["iteration"], gc.isenabled()))

        def after_backward(iteration, schedule):
            seen["iteration"] = iteration
            seen["gc_enabled"].append(gc.isenabled())

        plain_empty = Platform.empty_cache

        def empty_cache(self):
            seen["empty_cache"] += 1
            plain_empty(self)

        gc.callbacks.append(collected)
        Platform.empty_cache = empty_cache
        try:
            with probes.record_validation(validation):
                result = _with_after_backward(rank, world, tiny_gpt_args(**flags), after_backward, train_and_collect)
        finally:
            gc.callbacks.remove(collected)
            Platform.empty_cache = plain_empty
        result.update(seen, gc_enabled_after=gc.isenabled(), validation=validation)
        out[name] = result
    return out


def _with_after_backward(rank, world, argv, hook, train_and_collect):
    """train_and_collect, with ``hook(iteration, schedule)`` also called after each backward."""
    from megatron_weipipe.training import pretrain as pretrain_module

    plain = pretrain_module.pretrain

    def pretrain(cfg, model_provider, forward_step, *args, after_backward=None, **kwargs):
        def both(iteration, schedule):
            hook(iteration, schedule)
            if after_backward is not None:
                after_backward(iteration, schedule)
        return plain(cfg, model_provider, forward_step, *args, after_backward=both, **kwargs)

    pretrain_module.pretrain = pretrain
    try:
        return train_and_collect(rank, world, argv, collect_grads=False)
    finally:
        pretrain_module.pretrain = plain


# The reference is also the control of the housekeeping runs (automatic collection, level 0).
RUNS1 = [
    ("reference", dict(**EVAL, **CLOSE)),
    ("manual gc", dict(**EVAL, manual_gc=True, manual_gc_interval=2, empty_unused_memory_level=1)),
    ("manual gc, not around evaluation", dict(**EVAL, manual_gc=True, manual_gc_interval=2, no_manual_gc_eval=True,
                                              empty_unused_memory_level=2)),
]


@pytest.fixture(scope="module")
def world1():
    return run_distributed(_one_process, 1, RUNS1, timeout=600)[0]


@pytest.mark.parametrize("name,rtol", [("partial", RTOL), ("weipipe partial", WEIPIPE_RTOL)])
def test_partial_distributed_optimizer_trains_as_one_process(world4, world1, name, rtol):
    """Schedule none at DP=4, and weipipe-zb at DP=2 x PP=2 (its ring sums in another order:
    tests/test_weipipe_gpt_parity.py's tolerance), both with two optimizer instances."""
    ref = world1["reference"]
    for rank in world4:
        np.testing.assert_allclose(rank[name]["losses"], ref["losses"], rtol=rtol, atol=0)
        np.testing.assert_allclose(rank[name]["validation"], ref["validation"], rtol=rtol, atol=0)
    rel, where = max_relative_difference(assemble(rank[name]["params"] for rank in world4), assemble([ref["params"]]))
    assert rel < rtol, f"{name}: parameter {where} differs by {rel:.2e}"


def test_partial_distributed_optimizer_shards_inside_instances(world4):
    """DP=4 in two instances of two ranks: ranks 0 and 1 hold the two halves of the Adam state
    (instance 0), ranks 2 and 3 the same halves (instance 1); at N=1 each rank holds a quarter."""
    parts = [rank["partial"]["optimizer"] for rank in world4]
    assert [p["shard_group_size"] for p in parts] == [2, 2, 2, 2]
    assert [p["instance"] for p in parts] == [0, 0, 1, 1]
    half = [p["exp_avg"] for p in parts]
    np.testing.assert_array_equal(half[0], half[2])
    np.testing.assert_array_equal(half[1], half[3])
    whole = sum(len(h) for h in half[:2])
    quarters = [rank["none"]["optimizer"] for rank in world4]
    assert [q["shard_group_size"] for q in quarters] == [4, 4, 4, 4]
    assert sum(len(q["exp_avg"]) for q in quarters) == whole
    assert all(len(q["exp_avg"]) < 0.3 * whole for q in quarters)
    assert all(0.4 * whole < len(h) < 0.6 * whole for h in half)


def test_partial_distributed_optimizer_checkpoint_resumes_bitwise(world4):
    for rank in world4:
        full, resumed = rank["partial"], rank["partial resumed"]
        assert resumed["losses"] == full["losses"][SAVE_AT:]
        _same(resumed["params"], full["params"])


def test_manual_gc_turns_automatic_collection_off_and_collects_on_schedule(world1):
    auto, manual = world1["reference"], world1["manual gc"]
    assert len(auto["gc_enabled"]) == ITERS and all(auto["gc_enabled"]) and not any(manual["gc_enabled"])
    assert manual["gc_enabled_after"] and auto["gc_enabled_after"]
    # while automatic collection is off: one full collection at the start, one every 2
    # iterations, a full one before the evaluation after iteration 3 and a young one after it
    explicit = [(gen, it) for gen, it, enabled in manual["collections"] if not enabled]
    assert explicit == [(2, None), (2, 2), (2, 3), (0, 3)], explicit
    quiet = world1["manual gc, not around evaluation"]
    assert [(g, it) for g, it, enabled in quiet["collections"] if not enabled] == [(2, None), (2, 2)]


def test_empty_unused_memory_level_calls_the_platform(world1):
    """Level 1: after each of the 3 forward/backward passes and the one-batch evaluation;
    level 2: also after each of the 3 optimizer steps; level 0 (the reference): never."""
    assert world1["reference"]["empty_cache"] == 0
    assert world1["manual gc"]["empty_cache"] == ITERS + 1
    assert world1["manual gc, not around evaluation"]["empty_cache"] == 2 * ITERS + 1
