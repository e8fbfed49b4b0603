"""Megatron-LM's logging and profiling flags in real runs: ``--log-params-norm`` and
``--log-num-zeros-in-grad`` in the log line (against a count by hand, and under WeiPipe and
FSDP2 against the single-process run), ``--log-memory-to-tensorboard`` and
``--log-timers-to-tensorboard`` in the TensorBoard events, and ``--profile
--use-pytorch-profiler``'s Chrome trace of the profiled iterations."""

from __future__ import annotations

import gzip
import json
import math
import os
import re

import pytest

from harness import run_distributed
from harness.weipipe_gpt import argv

# Untied: the embedding rows of bytes the batch lacks get exactly zero gradient.
BASE = dict(num_layers=4, global_batch_size=8, train_iters=4, log_interval=2, log_params_norm=True,
            log_num_zeros_in_grad=True, untie_embeddings_and_output_weights=True)
PROFILED = (1, 3)  # --profile-step-start, --profile-step-end
TWO_RANKS = {
    "weipipe": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave"),
    "fsdp2": dict(use_torch_fsdp2=True),
}


def _unique_params(chunks):
    seen = {}
    for chunk in chunks:
        for p in chunk.parameters():
            seen[id(p)] = p
    return list(seen.values())


def train_logging(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """Each run's log fields per log line; a single-process run adds the norm and zeros by hand."""
    from megatron.core import parallel_state

    import pretrain_gpt
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    out = []
    for args in argvs:
        seen, logs = {}, []

        def after_backward(iteration, schedule):
            seen["chunks"] = schedule.model_chunks
            grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                     for p in _unique_params(schedule.model_chunks)]
            seen["zeros"] = sum(int((g == 0).sum()) for g in grads if g is not None)

        def on_log(stats):
            params = _unique_params(seen["chunks"])
            by_hand = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))
            logs.append(dict(iteration=stats["iteration"], params_norm=stats["params_norm"],
                             num_zeros=stats["num_zeros"], norm_by_hand=by_hand, zeros_by_hand=seen["zeros"]))

        pretrain(parse_config(args, world_size=world_size), pretrain_gpt.model_provider, forward_step,
                 after_backward=after_backward, on_log=on_log)
        parallel_state.destroy_model_parallel()
        out.append(logs)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tb = tmp_path_factory.mktemp("run") / "tb"
    args = argv(**BASE, tensorboard_dir=str(tb), log_memory_to_tensorboard=True, log_timers_to_tensorboard=True,
                profile=True, use_pytorch_profiler=True, profile_step_start=PROFILED[0],
                profile_step_end=PROFILED[1])
    [logs] = run_distributed(train_logging, 1, [args], timeout=300)[0]
    return logs, tb


def test_params_norm_and_num_zeros_match_a_count_by_hand(single):
    logs, _ = single
    assert [l["iteration"] for l in logs] == [2, 4]
    for l in logs:
        assert l["params_norm"] == pytest.approx(l["norm_by_hand"], rel=1e-6)
        assert l["num_zeros"] == l["zeros_by_hand"] > 0
    assert logs[0]["params_norm"] != logs[1]["params_norm"]  # read at the log iteration, after its step


def test_tensorboard_holds_memory_timers_norm_and_zeros(single):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_weipipe.platform import detect_platform

    logs, tb = single
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    memory = "mem-allocated-bytes" if detect_platform().is_cuda else "mem-peak-rss-bytes"
    assert {memory, "iteration-time", "throughput", "params-norm", "num-zeros"} <= tags, tags
    assert [e.step for e in events.Scalars("iteration-time")] == [2, 4]
    assert all(e.value > 0 for e in events.Scalars(memory))
    norms = [e.value for e in events.Scalars("params-norm")]
    assert norms == pytest.approx([l["params_norm"] for l in logs], rel=1e-6)


def test_pytorch_profiler_trace_holds_the_profiled_iterations(single):
    _, tb = single
    with gzip.open(os.path.join(os.path.dirname(tb), "torch_profile", "rank-0.json.gz"), "rt") as f:
        trace = json.load(f)
    steps = {e["name"] for e in trace["traceEvents"] if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name")))}
    assert steps == {f"ProfilerStep#{i}" for i in range(*PROFILED)}


@pytest.mark.distributed
def test_params_norm_and_num_zeros_under_weipipe_and_fsdp2_equal_one_process(single):
    logs, _ = single
    per_rank = run_distributed(train_logging, 2, [argv(**BASE, **flags) for flags in TWO_RANKS.values()],
                               timeout=600)
    for name, runs in zip(TWO_RANKS, zip(*per_rank)):
        for rank_logs in runs:
            got = [(l["params_norm"], l["num_zeros"]) for l in rank_logs]
            # the zeros are the unused vocabulary's rows; a ring sums a gradient in another order,
            # which can round one element more or less to exactly zero (15105 against 15104)
            want = [(pytest.approx(l["params_norm"], rel=1e-5), pytest.approx(l["num_zeros"], abs=2))
                    for l in logs]
            assert got == want, name


def test_nsight_profile_on_a_cpu_host_is_a_notice(capsys):
    from megatron_weipipe.logging_config import LoggingConfig
    from megatron_weipipe.platform import Platform
    from megatron_weipipe.training.profiling import StepProfiler

    profiler = StepProfiler(LoggingConfig(profile=True), Platform("cpu", "gloo"), rank=0)
    for i in range(12):
        profiler.before_iteration(i)
        profiler.after_iteration(i + 1)
    assert capsys.readouterr().out.count("not profiling") == 1
