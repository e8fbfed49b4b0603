"""WeiPipe with --overlap-grad-reduce: the owned chunk's data-parallel reduction starts at
the rank's OPTIMIZER_STEP, asynchronously, and training stays exact.

DP = 2 x ring of 2 (4 gloo processes), G = 2, every WeiPipe variant of the registry,
with and without the distributed optimizer. Inside the ranks, the runtime's actions and
megatron-core's bucket-group start_grad_sync / finish_grad_sync calls are recorded in
the order they happen; the test process reads that order. The same runs are compared
with the PP=1 reference (as tests/test_weipipe_gpt_parity.py compares) and with the same
run without the flag (today's path: one bucket reduced after the schedule).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from harness import run_distributed
from harness.state import max_relative_difference
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.ir.actions import Kind

from harness.weipipe_gpt import RTOL, WEIPIPE, argv, assert_matches, merge, train

P, G, DP, MICRO, LAYERS = 2, 2, 2, 2, 4


def _args(name: str, overlap: bool = True, distopt: bool = False) -> list[str]:
    return argv(num_layers=LAYERS, global_batch_size=MICRO * G * P * DP, pipeline_model_parallel_size=P,
                pipeline_schedule=name, recompute_granularity="full", recompute_method="uniform",
                overlap_grad_reduce=overlap, use_distributed_optimizer=distopt)


CONFIGS = {(name, distopt): _args(name, distopt=distopt) for name in WEIPIPE for distopt in (False, True)}
# Today's path (no flag), for the overlapped run to equal.
BASELINES = {("weipipe-zb", distopt, "off"): _args("weipipe-zb", overlap=False, distopt=distopt)
             for distopt in (False, True)}


# ---------------------------------------------------------------- inside the ranks

_EVENTS: list = []
_SEEN: dict = {}


def _install_recorders() -> None:
    """Wrap the runtime's action methods and the bucket groups' start/finish (once per process)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron_weipipe.schedules.runtime import ring
    from megatron_weipipe.schedules.gpt.weipipe import schedule as weipipe_schedule

    if _SEEN.get("installed"):
        return
    _SEEN["installed"] = True
    state = ring._IterationState
    for kind in Kind:
        method = getattr(state, "_" + kind.value, None)
        if method is None:
            continue

        def action(self, i, a, _method=method, _kind=kind.value):
            _EVENTS.append(("begin", _kind))
            try:
                return _method(self, i, a)
            finally:
                _EVENTS.append(("end", _kind))

        setattr(state, "_" + kind.value, action)

    run = state.run

    def recorded_run(self):
        _EVENTS.append(("schedule_begin",))
        run(self)
        _EVENTS.append(("schedule_end",))

    state.run = recorded_run

    forward_backward = weipipe_schedule.WeiPipeSchedule.forward_backward

    def remember(self, *args, **kwargs):
        _SEEN["schedule"] = self
        return forward_backward(self, *args, **kwargs)

    weipipe_schedule.WeiPipeSchedule.forward_backward = remember

    def kinds(group) -> tuple[int, int]:
        owned = {id(p) for p in _SEEN["schedule"].owned.values()}
        params = [p for b in group.buckets for p in b.params_list]
        n_owned = sum(id(p) in owned for p in params)
        return n_owned, len(params) - n_owned

    start, finish = _ParamAndGradBucketGroup.start_grad_sync, _ParamAndGradBucketGroup.finish_grad_sync

    def recorded_start(self, *args, **kwargs):
        already = self.grad_reduce_handle is not None
        out = start(self, *args, **kwargs)
        if not already:  # a call that dispatched a collective (not a no-op)
            _EVENTS.append(("start", *kinds(self), self.grad_reduce_handle is not None))
        return out

    def recorded_finish(self, *args, **kwargs):
        _EVENTS.append(("finish", *kinds(self)))
        return finish(self, *args, **kwargs)

    _ParamAndGradBucketGroup.start_grad_sync = recorded_start
    _ParamAndGradBucketGroup.finish_grad_sync = recorded_finish


def train_recorded(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    _install_recorders()
    out = []
    for a in argvs:
        _EVENTS.clear()
        run = train(rank, world_size, a)
        run["events"] = list(_EVENTS)
        run["pp_rank"] = _SEEN["schedule"].groups.pp_rank
        run["owned_params"] = len(_SEEN["schedule"].owned)
        out.append(run)
    return out


# ---------------------------------------------------------------- in the test process

@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    configs = {**CONFIGS, **BASELINES}
    per_rank = run_distributed(train_recorded, P * DP, list(configs.values()), timeout=900)
    return {key: ([r[i] for r in per_rank], merge(per_rank, i)) for i, key in enumerate(configs)}


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
    from harness.weipipe_gpt import train_many

    per_rank = run_distributed(train_many, 1, [argv(num_layers=LAYERS, global_batch_size=MICRO * G * P * DP)],
                               timeout=300)
    return merge(per_rank, 0)


def _iterations(events: list) -> list[list]:
    """The events of each iteration: from one schedule's begin to the next one's."""
    cuts = [i for i, e in enumerate(events) if e[0] == "schedule_begin"] + [len(events)]
    return [events[a:b] for a, b in zip(cuts, cuts[1:])]


def _check_order(events: list, n_owned: int, label: str) -> None:
    """One iteration of one rank: where the owned bucket(s) started and were waited for."""
    opt_begin = events.index(("begin", Kind.OPTIMIZER_STEP.value))
    opt_end = events.index(("end", Kind.OPTIMIZER_STEP.value), opt_begin)
    schedule_end = events.index(("schedule_end",))
    owned_starts = [(i, e) for i, e in enumerate(events) if e[0] == "start" and e[1] > 0]
    assert owned_starts, f"{label}: the owned chunk's data-parallel reduction never started"
    for i, (_, n_own, n_rep, is_async) in owned_starts:
        assert i < schedule_end, (f"{label}: the owned chunk's data-parallel reduction started after the "
                                  f"schedule's last action (event {i}, schedule ended at event {schedule_end})")
        assert opt_begin < i < opt_end, f"{label}: started outside OPTIMIZER_STEP (event {i})"
        assert n_rep == 0, f"{label}: a bucket started at grad_ready holds {n_rep} replicated parameters"
        assert is_async, f"{label}: the owned bucket's reduction was synchronous (no handle to wait on)"
    assert sum(e[1] for _, e in owned_starts) == n_owned, label
    waits = [i for i, e in enumerate(events) if e[0] == "finish"]
    assert waits and min(waits) > schedule_end, f"{label}: DDP waited inside the schedule"
    late = [e for e in events[schedule_end:] if e[0] == "start"]
    assert all(e[1] == 0 for e in late), f"{label}: owned parameters reduced again after the schedule"


@pytest.mark.distributed
@pytest.mark.parametrize("distopt", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
@pytest.mark.parametrize("name", WEIPIPE)
def test_owned_chunk_reduction_starts_at_grad_ready(name, distopt):
    """GPU defect guarded: with DP > 1 every WeiPipe rank waited for the whole data-parallel
    all-reduce / reduce-scatter of its owned chunk after the schedule (DDP forced to
    overlap_grad_reduce=False, grad_ready unused), so on a GPU nothing overlapped it. Here,
    in every iteration on every rank, the owned chunk's bucket(s) are started inside the
    rank's OPTIMIZER_STEP action, asynchronously (a handle is left to wait on), hold no
    replicated parameter, cover every owned parameter, and are waited for only after the
    schedule; on ring rank P-1, whose list goes on after OPTIMIZER_STEP, that is before its
    last action."""
    per_rank, _ = _runs()[(name, distopt)]
    plan = generate(name, P, G)
    for run in per_rank:
        r = run["pp_rank"]
        its = _iterations(run["events"])
        assert len(its) == 3, len(its)
        trailing = len(plan.actions(r)) - 1 - [a.kind for a in plan.actions(r)].index(Kind.OPTIMIZER_STEP)
        for it, events in enumerate(its, 1):
            _check_order(events, run["owned_params"], f"{name} distopt={distopt} ring rank {r} iteration {it}")
            if trailing:  # the overlap window: actions that run while the reduction is in flight
                start = next(i for i, e in enumerate(events) if e[0] == "start" and e[1] > 0)
                after = [e for e in events[start:] if e[0] == "begin"]
                assert len(after) == trailing, (name, r, it, len(after), trailing)


@pytest.mark.distributed
@pytest.mark.parametrize("distopt", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
@pytest.mark.parametrize("name", WEIPIPE)
def test_overlapped_reduction_matches_reference(name, distopt):
    """Losses, every reduced gradient (plain optimizer; the distributed optimizer keeps a
    shard only, so there losses and parameters) and the parameters after 3 steps equal
    the PP=1 reference."""
    _, run = _runs()[(name, distopt)]
    reference = _reference()
    if not distopt:
        assert_matches(run, reference, name)
        return
    for losses in run["loss_sets"]:
        np.testing.assert_allclose(losses, reference["losses"], rtol=RTOL)
    rel, where = max_relative_difference(run["params"], reference["params"])
    assert rel < RTOL, f"{name}: parameter {where} differs by {rel:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("distopt", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_overlap_equals_todays_path(distopt):
    """The same run with and without --overlap-grad-reduce: the same sums in another
    bucket layout, so the same losses, gradients and parameters, bit for bit with the
    plain optimizer. The distributed optimizer's shards follow the buckets, so its
    gradient norm (for clipping) sums the squares in another order: parameters agree
    to rounding there (measured 1e-7 relative after 3 steps)."""
    _, on = _runs()[("weipipe-zb", distopt)]
    per_rank_off, off = _runs()[("weipipe-zb", distopt, "off")]
    exact = 0.0 if not distopt else RTOL
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=exact, atol=0)
    rel, where = max_relative_difference(on["params"], off["params"])
    assert rel <= exact, f"parameter {where} differs by {rel:.2e}"
    if not distopt:
        for it in off["grads"]:
            rel, where = max_relative_difference(on["grads"][it], off["grads"][it])
            assert rel == 0.0, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    for run in per_rank_off:  # without the flag: one bucket, reduced after the schedule
        for events in _iterations(run["events"]):
            end = events.index(("schedule_end",))
            assert all(i > end for i, e in enumerate(events) if e[0] in ("start", "finish"))


def test_mixed_bucket_is_reduced_after_the_schedule(caplog):
    """Degrade path: a bucket group holding owned and replicated parameters (a layout
    megatron-core might produce if it aligned otherwise) is not started at grad_ready
    (its replicated half is not summed over the ring yet), with one logged line."""
    from types import SimpleNamespace

    import torch

    from megatron_weipipe.schedules.gpt.weipipe.grad_sync import _split_bucket_groups, owned_bucket_size

    own = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5)]
    rep = [torch.nn.Parameter(torch.zeros(7))]

    def group(*params):
        return SimpleNamespace(buckets=[SimpleNamespace(params_list=list(params))])

    pure, mixed, replicated = group(own[0]), group(own[1], rep[0]), group(rep[0])
    ddp = SimpleNamespace(bucket_groups=[pure, mixed, replicated], expert_parallel_bucket_groups=[],
                          ddp_config=SimpleNamespace(overlap_grad_reduce=True))
    with caplog.at_level("WARNING"):
        early, late = _split_bucket_groups(ddp, own)
    assert early == [pure] and late == [mixed, replicated]
    assert sum("mix owned and replicated" in r.message for r in caplog.records) == 1
    # DDP walks the owned parameters last-first; with the distributed optimizer each start is 64-aligned.
    assert owned_bucket_size(own, distributed_optimizer=False) == 8
    assert owned_bucket_size(own, distributed_optimizer=True) == 64 + 3

