"""--rampup-batch-size and --step-batch-size-schedule: Megatron-LM's batch size and learning rate per iteration.

References: megatron-core's own microbatch calculator and OptimizerParamScheduler, driven as
Megatron-LM's training loop drives them (its update_train_iters, then per iteration
update_num_microbatches at the samples consumed, the scheduler stepped by the iteration's
samples). Where the installed megatron-core has no calculator of the kind (the ramp from 0.18
on, the step schedule before it) the reference is the formula Megatron-LM documents.

The ramp of the trained runs: START 4, INCREMENT 4, 24 samples, --global-batch-size 12,
--train-samples 60: batch sizes 4 4 4 8 8 12 12 (7 iterations; WeiPipe at P=2 runs G = 1, 2
and 3, a plan for each). One single-process spawn runs the reference, a fixed-batch control,
a run stopped after iteration 4 and its resumption, and an iteration-based step schedule; one
two-rank spawn the ramp under weipipe-zb and 1f1b at PP=2.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
from dataclasses import replace

import numpy as np
import pytest

from harness import run_distributed
from harness.state import max_relative_difference
from harness.weipipe_gpt import RTOL, argv

from megatron_weipipe import batch_sizes, mcore_versions
from megatron_weipipe.arguments import check_config, parse_config
from megatron_weipipe.config import ConfigError

MICRO, SEQ, LR, MIN_LR = 2, 32, 1e-3, 1e-4
RAMP = ["4", "4", "24"]  # START INCREMENT RAMPUP_SAMPLES
SAMPLE_RUN = dict(train_iters=None, train_samples=60, global_batch_size=12, lr=LR, min_lr=MIN_LR,
                  lr_warmup_samples=8, log_interval=1)
STEP_TEXT = "0:4 384:8 768:12"  # thresholds in tokens: 4 from 0, 8 from 12 samples, 12 from 24 samples on
STEP_RUN = dict(train_iters=6, global_batch_size=None, lr=LR, min_lr=MIN_LR, lr_warmup_iters=1, lr_decay_iters=6,
                log_interval=1, step_batch_size_schedule=STEP_TEXT)
RAMP_SIZES = [4, 4, 4, 8, 8, 12, 12]


def _ramp_argv(**extra) -> list[str]:
    return argv(**SAMPLE_RUN, **extra) + ["--rampup-batch-size", *RAMP]


# --- megatron-core driven as Megatron-LM drives it ---------------------------------------------------


class _DocumentedRamp:
    """Megatron-LM's documented ramp, for releases whose megatron-core dropped its ramp calculator:
    START + int(consumed / (RAMPUP_SAMPLES / increments)) x INCREMENT up to RAMPUP_SAMPLES, then the final size."""

    def __init__(self, start, increment, samples, final):
        self.start, self.increment, self.samples, self.final = start, increment, samples, final
        self.per_increment = samples / ((final - start) // increment)
        self.size = start

    def update(self, consumed, consistency_check, verbose=False):
        steps = int(consumed / self.per_increment)
        self.size = self.final if consumed > self.samples else self.start + steps * self.increment

    def get_current_global_batch_size(self):
        return self.size


class _DocumentedSteps(_DocumentedRamp):
    """Megatron-LM's documented step schedule (thresholds in tokens, // --seq-length), for releases before 0.18."""

    def __init__(self, text, seq_length):
        pairs = sorted((int(float(t)) // seq_length, int(b)) for t, b in (e.split(":") for e in text.split()))
        self.pairs, self.size = pairs, pairs[0][1]

    def update(self, consumed, consistency_check, verbose=False):
        self.size = [b for t, b in self.pairs if consumed >= t][-1]


def _megatron_core_calculator(global_batch_size, ramp=None, step=None, dp=1):
    """megatron-core's calculator of the kind, through its init function as Megatron-LM calls it."""
    from megatron.core import num_microbatches_calculator as calculators

    have_ramp = mcore_versions.microbatch_calculator_class("Rampup") is not None
    have_step = mcore_versions.microbatch_calculator_class("Step") is not None
    if (ramp is not None and not have_ramp) or (step is not None and not have_step):
        return None
    calculators.destroy_num_microbatches_calculator()
    kwargs = dict(rank=0, rampup_batch_size=ramp, global_batch_size=global_batch_size, micro_batch_size=MICRO,
                  data_parallel_size=dp, decrease_batch_size_if_needed=False)
    if step is not None:
        kwargs.update(step_batch_size_schedule=step, seq_length=SEQ)
    calculators.init_num_microbatches_calculator(**kwargs)
    return calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR


def _reference_calculator(global_batch_size, ramp=None, step=None):
    calc = _megatron_core_calculator(global_batch_size, ramp, step)
    if calc is not None:
        return calc
    if ramp is not None:
        return _DocumentedRamp(*ramp, global_batch_size)
    return _DocumentedSteps(step, SEQ)


def _scheduler(decay_steps, warmup_steps, wd_steps):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{}]

    optimizer = Groups()
    return optimizer, OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=wd_steps, wd_incr_style="constant")


def megatron_lm_sequence(ramp=None, step=None, train_samples=None, train_iters=None, global_batch_size=12,
                         lr_warmup=8, lr_decay=None):
    """(global batch size, learning rate after the step, samples consumed) per iteration, as
    Megatron-LM trains: update_train_iters, then per iteration the calculator at the samples
    consumed and the scheduler stepped by the iteration's samples. Warm-up and decay lengths are
    in samples for a sample-based run, in iterations times --global-batch-size otherwise."""
    calc = _reference_calculator(global_batch_size, ramp, step)
    if train_iters is None:  # update_train_iters: 0.17's ramp loop, or the step-schedule loop
        consumed = train_iters = 0
        bound = int(ramp[2]) if ramp is not None else None
        while (consumed <= bound and consumed <= train_samples) if ramp is not None else consumed < train_samples:
            calc.update(consumed, False)
            consumed += calc.get_current_global_batch_size()
            train_iters += 1
        if ramp is not None and train_samples > consumed:
            train_iters += (train_samples - consumed) // global_batch_size
        optimizer, scheduler = _scheduler(lr_decay or train_samples, lr_warmup, train_samples)
    else:
        optimizer, scheduler = _scheduler((lr_decay or train_iters) * global_batch_size,
                                          lr_warmup * global_batch_size, train_iters * global_batch_size)
    out, consumed = [], 0
    for _ in range(train_iters):
        calc.update(consumed, True)
        size = calc.get_current_global_batch_size()
        scheduler.step(increment=size)
        consumed += size
        out.append((size, optimizer.param_groups[0]["lr"], consumed))
    return out


def _logged(run: dict) -> list[tuple]:
    return [(s["global_batch_size"], s["lr"], s["consumed_samples"]) for s in run["stats"]]


# --- without training ------------------------------------------------------------------------------

RAMPS = [(4, 4, 24, 12), (16, 16, 5859375, 1536), (3, 2, 10, 9), (2, 2, 3, 12), (32, 32, 65324160, 128),
         (1, 1, 7, 100)]


def _probe_points(steps: batch_sizes.Steps, samples: int) -> list[int]:
    points = set(range(0, min(samples, 3000) + 3))
    for start in steps.starts:
        points.update(range(max(start - 2, 0), start + 3))
    points.update(range(samples - 2, samples + 3))
    return sorted(points)


@pytest.mark.parametrize("ramp", RAMPS, ids=[" ".join(map(str, r)) for r in RAMPS])
def test_ramp_as_steps_is_megatron_cores_ramp(ramp):
    """The ramp's steps (what megatron-core 0.18+'s step calculator runs) give the batch size of
    megatron-core's ramp calculator (0.16, 0.17; else Megatron-LM's formula) at every consumed count
    near a change, and the whole ramp where it is short."""
    start, increment, samples, final = ramp
    steps = batch_sizes.ramp_steps([start, increment, samples], final)
    reference = _reference_calculator(final, ramp=[start, increment, samples])
    for consumed in _probe_points(steps, samples):
        reference.update(consumed, False)
        assert steps.size_at(consumed) == reference.get_current_global_batch_size(), consumed


def test_the_run_drives_megatron_cores_calculator():
    """The calculator a run builds is megatron-core's where the release has the kind (the ramp
    on 0.18+ as steps in its step calculator) and gives the reference's sizes; the step schedule's
    text is read as megatron-core reads it."""
    from megatron_weipipe.training.batch_size import BatchSizes, StepsCalculator

    ramp_class, step_class = (mcore_versions.microbatch_calculator_class(k) for k in ("Rampup", "Step"))
    for flags, ramp, step, expected in ((_ramp_argv(), [4, 4, 24], None, ramp_class or step_class),
                                        (argv(**STEP_RUN), None, STEP_TEXT, step_class or StepsCalculator)):
        batches = BatchSizes(parse_config(flags), 0)
        assert type(batches.calculator) is expected
        reference = _reference_calculator(12, ramp, step)
        sizes = []
        for consumed in range(0, 40):
            batches.update(consumed, consistency_check=False)
            reference.update(consumed, False)
            assert batches.global_batch_size == reference.get_current_global_batch_size(), consumed
            sizes.append(batches.global_batch_size)
        assert sorted(set(sizes)) == [4, 8, 12]
    text = "0:16 2.4B:320 4.8b:624 7.2B:928 9.6B:1232 12B:1536"  # Megatron-LM's GPT-3 175B example
    suffixed = batch_sizes.parse_step_schedule(text, 2048)
    assert suffixed.starts[1] == 2_400_000_000 // 2048 and suffixed.sizes == (16, 320, 624, 928, 1232, 1536)
    if step_class is not None:
        assert step_class._parse_schedule(text, 2048) == list(zip(suffixed.starts, suffixed.sizes))


def test_run_length_and_batch_sizes_are_megatron_lms():
    cfg = parse_config(_ramp_argv())
    expected = megatron_lm_sequence(ramp=[4, 4, 24], train_samples=60)
    assert cfg.train_iters == len(expected) == 7
    assert [size for size, _, _ in expected] == RAMP_SIZES
    assert cfg.train_samples_read >= expected[-1][2]
    step = parse_config(argv(**STEP_RUN))
    assert step.training.global_batch_size == 12  # the schedule's last
    assert [size for size, _, _ in megatron_lm_sequence(step=STEP_TEXT, train_iters=6, lr_warmup=1,
                                                        lr_decay=6)] == [4, 4, 4, 8, 8, 12]


def _one_line(flags, world_size=1, extra=()) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(argv(**flags) + list(extra), world_size=world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_ramp_the_ring_cannot_divide_is_refused_in_one_line():
    ring = dict(SAMPLE_RUN, pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb")
    assert parse_config(_ramp_argv(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb"), world_size=2)
    line = _one_line(ring, 2, ["--rampup-batch-size", "2", "2", "24"])  # 1, 2, ... microbatches: G = 1/2
    assert line.startswith("--pipeline-schedule weipipe-zb (G = microbatches / ring size) needs the number of "
                           "microbatches per replica to be a multiple of --pipeline-model-parallel-size (2); "
                           "--rampup-batch-size reaches global batch size 2 at iteration 1"), line
    line = _one_line(dict(ring, pipeline_schedule="interleaved", num_layers_per_virtual_pipeline_stage=1), 2,
                     ["--rampup-batch-size", "2", "2", "24"])
    assert line.startswith("--pipeline-schedule interleaved needs"), line
    assert parse_config(argv(**dict(ring, pipeline_schedule="1f1b")) + ["--rampup-batch-size", "2", "2", "24"],
                        world_size=2)  # 1F1B runs any count


@pytest.mark.parametrize("flags, extra, line", [
    (SAMPLE_RUN, ["--rampup-batch-size", "3", "3", "24"], "--rampup-batch-size reaches global batch size 3 at "
     "iteration 1 (0 samples consumed), which --micro-batch-size x data-parallel size (2 x 1) does not divide"),
    (dict(SAMPLE_RUN, train_samples=None, train_iters=5), ["--rampup-batch-size", *RAMP],
     "--rampup-batch-size needs --train-samples"),
    (SAMPLE_RUN, ["--rampup-batch-size", "12", "4", "24"], "--rampup-batch-size START (12) must be smaller"),
    (SAMPLE_RUN, ["--rampup-batch-size", "4", "3", "24"], "--rampup-batch-size: --global-batch-size minus START"),
    (dict(STEP_RUN, global_batch_size=16), [], "--global-batch-size (16) must be the last batch size of"),
    (dict(STEP_RUN, step_batch_size_schedule="0:256 384:128"), [], "--step-batch-size-schedule: batch sizes must "
                                                                    "not decrease"),
    (dict(STEP_RUN, step_batch_size_schedule="64:128"), [], "--step-batch-size-schedule: the first threshold"),
    (dict(STEP_RUN, decrease_batch_size_if_needed=True), [], "--decrease-batch-size-if-needed cannot be combined"),
])
def test_schedules_megatron_lm_refuses_are_refused_in_one_line(flags, extra, line):
    assert _one_line(flags, 1, extra).startswith(line)


def test_a_resumed_schedule_is_checked_from_the_checkpoint_on():
    """Megatron-LM checks the current batch size after loading: sizes a run with more data-parallel
    ranks left behind are not refused (at start-up they are, unless --load may resume past them)."""
    flags = dict(STEP_RUN, micro_batch_size=4, step_batch_size_schedule="0:4 384:8 768:16")
    cfg = parse_config(argv(**flags, load="/nonexistent"), world_size=2)  # DP 2: a unit of 8
    assert _one_line(flags, 2).startswith("--step-batch-size-schedule reaches global batch size 4 at iteration 1")
    check_config(replace(cfg, resumed_at=(3, 12)), check_data=False)
    with pytest.raises(ConfigError):
        check_config(replace(cfg, resumed_at=(0, 0)), check_data=False)


def test_decrease_batch_size_if_needed_rounds_down_as_megatron_core():
    cfg = parse_config(argv(global_batch_size=10, decrease_batch_size_if_needed=True), world_size=2)
    from megatron_weipipe.training.batch_size import BatchSizes

    batches = BatchSizes(cfg, 0)  # DP 2 x micro batch 2: 10 rounds down to 8
    assert (cfg.num_microbatches, batches.num_microbatches, batches.global_batch_size) == (2, 2, 8)
    assert _one_line(dict(global_batch_size=10), 2).startswith("--global-batch-size (10) must be divisible")


# --- trained runs ------------------------------------------------------------------------------------


def _train(rank: int, world_size: int, args: list[str]) -> dict:
    import contextlib
    import io

    import pretrain_gpt
    from megatron.core import parallel_state

    from harness.state import local_shards
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(args, world_size=world_size)
    stats, seen = [], {}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, on_log=stats.append,
                         after_backward=lambda it, schedule: seen.update(schedule=schedule))
    schedule = seen["schedule"]
    out = dict(losses=state.losses, stats=stats, params=local_shards(schedule.model_chunks, "param"),
               plans=sorted(getattr(schedule, "runtimes", {})), log=log.getvalue())
    parallel_state.destroy_model_parallel()
    return out


def _train_all(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    return [_train(rank, world_size, a) for a in argvs]


@pytest.fixture(scope="module")
def single():
    with tempfile.TemporaryDirectory() as ckpt:
        save = dict(save=ckpt, exit_interval=4)
        runs = run_distributed(_train_all, 1, [
            _ramp_argv(), argv(**SAMPLE_RUN), _ramp_argv(**save), _ramp_argv(load=ckpt), argv(**STEP_RUN),
        ], timeout=600)[0]
    from harness.state import assemble

    for run in runs:
        run["params"] = assemble([run["params"]])
    return dict(zip(("ramp", "fixed", "first_half", "resumed", "step"), runs))


@pytest.fixture(scope="module")
def pipelined():
    from harness.state import assemble

    per_rank = run_distributed(_train_all, 2, [
        _ramp_argv(pipeline_model_parallel_size=2, pipeline_schedule=name) for name in ("weipipe-zb", "1f1b")
    ], timeout=600)
    return {name: dict(losses=per_rank[0][i]["losses"], stats=per_rank[0][i]["stats"],
                       plans=[r[i]["plans"] for r in per_rank],
                       params=assemble(r[i]["params"] for r in per_rank))
            for i, name in enumerate(("weipipe-zb", "1f1b"))}


def test_ramped_run_has_megatron_lms_batch_sizes_and_learning_rates(single):
    expected = megatron_lm_sequence(ramp=[4, 4, 24], train_samples=60)
    assert _logged(single["ramp"]) == expected
    # negative control: at a fixed batch size the same comparison fails
    assert _logged(single["fixed"]) != expected and len(single["fixed"]["stats"]) == 60 // 12
    # throughput counts the iteration's own batch: tokens/s x time per iteration = its tokens
    for s in single["ramp"]["stats"]:
        assert s["tokens_per_second"] * s["elapsed_ms"] / 1000 == pytest.approx(s["global_batch_size"] * SEQ)


def test_iteration_based_step_schedule_has_megatron_lms_batch_sizes_and_learning_rates(single):
    expected = megatron_lm_sequence(step=STEP_TEXT, train_iters=6, lr_warmup=1, lr_decay=6)
    assert _logged(single["step"]) == expected
    assert _logged(single["fixed"]) != expected[:5]


def _params_close(a: dict, b: dict) -> float:
    """The largest relative difference of two runs' parameters, tensor by tensor."""
    return max_relative_difference(a, b)[0]


@pytest.mark.parametrize("name", ["weipipe-zb", "1f1b"])
def test_ramped_pipelines_match_the_single_process_run(name, single, pipelined):
    run, ref = pipelined[name], single["ramp"]
    assert _logged(run) == _logged(ref)
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=RTOL)
    assert _params_close(run["params"], ref["params"]) < RTOL
    if name == "weipipe-zb":  # a validated plan for each G the ramp reached (1, 2, 3 microbatches per ring rank)
        assert all(plans == [1, 2, 3] for plans in run["plans"])
    # negative control: the fixed-batch run's parameters are far from these
    assert _params_close(single["fixed"]["params"], ref["params"]) > 100 * RTOL


def test_a_run_resumed_in_the_ramp_continues_exactly(single):
    first, resumed, ref = single["first_half"], single["resumed"], single["ramp"]
    # Megatron-LM saves when the number of microbatches changes (before iteration 4), then at the exit
    saved = [int(i) for i in re.findall(r"saved checkpoint at iteration +(\d+)", first["log"])]
    assert saved == [3, 4]
    assert len(first["losses"]) == 4 and len(resumed["losses"]) == 3
    assert first["losses"] + resumed["losses"] == ref["losses"]
    assert _logged(first) + _logged(resumed) == _logged(ref)
    assert _params_close(resumed["params"], ref["params"]) == 0.0
    assert _params_close(single["fixed"]["params"], resumed["params"]) > 100 * RTOL  # the check can fail
