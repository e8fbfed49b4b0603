"""Measured busy, idle and bubble from per-action traces (timing/measured.py and
tools/schedule_timeline.py --from-trace), on hand-made traces with known answers. The
end-to-end check (real runs writing traces) is test_weipipe_gpt_parity.py's
test_schedule_trace_has_every_action_of_the_plan."""

from __future__ import annotations

import json
import os

import pytest
from tools import schedule_timeline

from megatron_weipipe.schedules.timing.measured import TraceError, between_iterations_s, load, measure


def _event(name, cat, ts, dur, it, **args):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 0,
            "args": {"iteration": it, **args}}


def _write(d, rank, events, **meta):
    other = {"schedule": "weipipe-zb", "rank": rank, "pipeline_size": 2, "num_microbatches": 2, **meta}
    with open(os.path.join(d, f"rank{rank}.json"), "w") as f:
        json.dump({"traceEvents": [{"name": "process_name", "ph": "M", "pid": rank}] + events, "otherData": other}, f)


def _two_ranks(d):
    """Iteration k spans [1000k, 1000k + 100] us on rank 0 and [1000k + 10, 1000k + 120]
    on rank 1 (window 120 us). Rank 0 computes 60 us, rank 1 90 us. Iteration 1 is a
    slow warm-up that must not count; optimizer steps follow every iteration and must
    not count either."""
    r0, r1 = [], []
    for it in (1, 2, 3):
        base = 1000 * it
        slow = 10 if it == 1 else 1
        r0 += [_event("iteration", "iteration", base, 100, it),
               _event("forward", "compute", base, 30 * slow, it), _event("recv", "wait", base + 30, 20, it),
               _event("backward_input", "compute", base + 50, 20, it),
               _event("backward_weight", "compute", base + 70, 10, it),
               _event("optimizer", "optimizer", base + 200, 500, it)]
        r1 += [_event("iteration", "iteration", base + 10, 110, it),
               _event("forward", "compute", base + 20, 40, it), _event("send", "send", base + 60, 5, it),
               _event("backward_input", "compute", base + 70, 30, it),
               _event("backward_weight", "compute", base + 100, 20, it),
               _event("optimizer", "optimizer", base + 200, 500, it)]
    _write(d, 0, r0)
    _write(d, 1, r1)


def test_measured_bubble_is_idle_over_all_ranks_without_first_iteration_or_optimizer(tmp_path):
    _two_ranks(str(tmp_path))
    m = measure(load(str(tmp_path)))
    assert m.iterations == [2, 3]
    # window 120 us per iteration; busy 60 and 90 us; two iterations.
    assert m.ranks[0].busy_s == pytest.approx(2 * 60e-6) and m.ranks[0].idle_s == pytest.approx(2 * 60e-6)
    assert m.ranks[1].busy_s == pytest.approx(2 * 90e-6) and m.ranks[1].idle_s == pytest.approx(2 * 30e-6)
    assert m.measured_bubble == pytest.approx(90 / 240)
    assert m.ranks[0].wait_s == pytest.approx(2 * 20e-6) and m.ranks[1].send_s == pytest.approx(2 * 5e-6)
    assert m.ranks[0].send_s == 0 and m.ranks[1].wait_s == 0
    assert m.mean_cost_s["forward"] == pytest.approx(35e-6)
    assert m.iteration_s == pytest.approx([120e-6, 120e-6])


def test_between_iterations_is_the_loop_outside_the_schedule_and_the_step(tmp_path):
    _two_ranks(str(tmp_path))
    # iteration 2 ends at 2100 us on rank 0 and 2120 us on rank 1, iteration 3 starts at
    # 3000 and 3010 us; the 500 us optimizer steps between them do not count, nor does the
    # gap after the warm-up; rank 1, the last to end, waited for no one: 390 us, not 400
    assert between_iterations_s(load(str(tmp_path))) == pytest.approx([390e-6])


def test_tool_json_and_text(tmp_path, capsys):
    _two_ranks(str(tmp_path))
    assert schedule_timeline.main(["--from-trace", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_bubble"] == pytest.approx(90 / 240)
    assert [r["busy_s"] for r in out["ranks"]] == pytest.approx([120e-6, 180e-6])
    assert [r["idle_s"] for r in out["ranks"]] == pytest.approx([120e-6, 60e-6])
    # planned: the zb plan of P=2, G=1 at the measured mean costs (F 35, I 25, W 15 us)
    F, I, W = 35e-6, 25e-6, 15e-6
    assert out["planned_makespan_s"] == pytest.approx(2 * (F + I + W) + max(F, I, W))
    assert schedule_timeline.main(["--from-trace", str(tmp_path), "--width", "24"]) == 0
    text = capsys.readouterr().out
    assert "measured bubble 0.3750" in text and "rank  1 |" in text and "planned at the measured costs" in text


def test_bad_trace_directory_is_one_line_exit_2(tmp_path, capsys):
    assert schedule_timeline.main(["--from-trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no rank*.json" in err
    _write(str(tmp_path), 0, [_event("iteration", "iteration", 0, 10, 1)])
    with pytest.raises(TraceError, match="at least 2 iterations"):
        measure(load(str(tmp_path)))


def test_tracer_appends_and_the_file_stays_valid_json(tmp_path):
    """ActionTracer writes the JSON array format, appending per iteration; load() reads
    it back with the last metadata."""
    from megatron_weipipe.schedules.generate.weipipe import generate
    from megatron_weipipe.schedules.runtime.trace import ActionTracer

    tracer = ActionTracer(str(tmp_path), 3, "weipipe-zb", {"pipeline_size": 2, "num_microbatches": 2})
    actions = generate("weipipe-zb", 2, 1).actions(1)
    sizes = []
    for it in range(2):
        with tracer.iteration_span():
            for a in actions:
                with tracer.action(a):
                    pass
        tracer.meta["wgrad_peak_bytes"] = it
        with tracer.phase("optimizer"):
            pass
        with open(tracer.path) as f:
            data = json.load(f)  # valid after every iteration
        sizes.append(len(data))
    assert sizes[1] - sizes[0] == sizes[0] - 1  # the process_name event once, then the same per iteration
    (t,) = load(str(tmp_path))
    assert t.rank == 3 and t.schedule == "weipipe-zb" and t.meta["wgrad_peak_bytes"] == 1
    per_it = [e for e in t.events if e["args"]["iteration"] == 2 and e["cat"] not in ("iteration", "optimizer")]
    assert [e["name"] for e in per_it] == [a.kind.value for a in actions]


def test_schedule_trace_flag_must_name_a_directory(tmp_path):
    from harness.runs import tiny_gpt_args

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.errors import ConfigError

    cfg = parse_config(tiny_gpt_args(schedule_trace=str(tmp_path / "traces")))
    assert cfg.logging.schedule_trace == str(tmp_path / "traces")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--schedule-trace must name a directory"):
        parse_config(tiny_gpt_args(schedule_trace=str(tmp_path / "file")))


# ---------------------------------------------------------------- device clock on a fake GPU

T0 = 1_700_000_000_000_000  # microseconds since the epoch: the fake host's and device's common clock
COST_US = {"forward": 3000, "loss": 400, "backward": 5000, "backward_input": 2500, "backward_weight": 1500}
RECV_US = 7000  # how long the stream waits for each message
ADAM_US = 2000


class _FakeGPU:
    """The host and one CUDA stream on one scripted timeline (integer microseconds). The
    host runs ahead of the device: launching a kernel costs the host 20 us and the stream
    the kernel's time; NCCL's work.wait() makes the stream wait for the message and returns
    to the host at once (2 us); an event recorded now completes when the stream reaches it,
    at max(stream, host). `syncs` lists every host wait for the device."""

    def __init__(self):
        self.host_us = self.stream_us = T0
        self.syncs = 0

    def now_on_stream(self) -> int:
        return max(self.stream_us, self.host_us)

    def occupy_stream(self, device_us: int, host_us: int) -> tuple[int, int]:
        start = self.now_on_stream()
        self.stream_us = start + device_us
        self.host_us += host_us
        return start, self.stream_us

    def event_class(self):
        gpu = self

        class FakeEvent:
            def __init__(self, enable_timing=False):
                assert enable_timing, "timing events are needed for elapsed_time"
                self.t = None

            def record(self, stream=None):
                self.t = gpu.now_on_stream()

            def synchronize(self):
                gpu.syncs += 1
                gpu.host_us = max(gpu.host_us, self.t)

            def query(self):
                return self.t <= gpu.host_us

            def elapsed_time(self, end):
                return (end.t - self.t) / 1000.0  # milliseconds, as CUDA's

        return FakeEvent


def _traced_schedule_on_fake_gpu(tmp_path, monkeypatch, gpu):
    """A schedule's tracer built as the trainer builds it (TrainSchedule.__init__), on a CUDA
    platform whose events and host clock are the fake GPU's."""
    import time
    from types import SimpleNamespace

    import torch

    from harness.runs import tiny_gpt_args
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.context import RunContext
    from megatron_weipipe.platform import Platform
    from megatron_weipipe.schedules.gpt.base import TrainSchedule

    class Traced(TrainSchedule):
        def build_model(self, model_provider):
            return []

        def forward_backward(self, forward_step, microbatches, forward_only=False):
            raise NotImplementedError

    monkeypatch.setattr(time, "time_ns", lambda: int(gpu.host_us) * 1000)
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = parse_config(tiny_gpt_args(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb",
                                     global_batch_size=4, schedule_trace=str(tmp_path)), world_size=2)
    ctx = RunContext(SimpleNamespace(pp_size=2, pp_rank=0, dp_rank=0), Platform("cuda", "nccl"), None)
    schedule = Traced(cfg, ctx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # only the tracer's probe saw a GPU
    return schedule


def _at(times):
    """Timestamps near the epoch (1.7e15 us): a relative tolerance would allow ~30 min."""
    return pytest.approx(times, rel=0, abs=0.01)


def _rank0_actions():
    """Rank 0's action list of weipipe-zb, P = 2, G = 1 (the traced schedule's plan)."""
    from megatron_weipipe.schedules.generate.weipipe import generate

    return generate("weipipe-zb", 2, 1).actions(0)


def _run_on_fake_gpu(schedule, gpu, iterations):
    """Rank 0's actions of weipipe-zb (P=2, G=1) per iteration, then an optimizer step;
    returns the device interval of every compute and receive action, per iteration."""
    actions = _rank0_actions()
    truth = []
    for it in range(1, iterations + 1):
        device = {"actions": []}
        with schedule.trace_iteration():
            device["start"] = gpu.now_on_stream()
            for a in actions:
                with schedule.tracer.action(a):
                    kind = a.kind.value
                    if kind in COST_US:  # a kernel: launched, then the host moves on
                        span = gpu.occupy_stream(COST_US[kind], host_us=20)
                    elif kind == "recv":  # work.wait(): the stream waits, the host does not
                        span = gpu.occupy_stream(RECV_US, host_us=2)
                    else:  # posting a send (NCCL's own stream), bookkeeping: host only
                        gpu.host_us += 10
                        span = None
                if span:
                    device["actions"].append((kind, *span))
            device["end"] = gpu.now_on_stream()
        with schedule.trace_span("optimizer"):
            device["optimizer"] = gpu.occupy_stream(ADAM_US, host_us=50)
        gpu.host_us += 300  # the loop between iterations (data, zeroing gradients)
        truth.append(device)
    return truth


def test_cuda_platform_traces_device_times_not_host_times(tmp_path, monkeypatch, capsys):
    """GPU defect guarded: host timestamps on a GPU (kernels enqueue asynchronously, NCCL's
    work.wait() does not block the host) make every receive look free and every compute
    action as short as its launch, so the measured bubble, the mean costs and any
    calibration from the trace are wrong. On a CUDA platform the tracer must time spans
    with CUDA events: the trace then holds the device's durations and timestamps (on the
    host's wall clock), the readers see them, the metadata names the clock, and the host
    waits for the device once per iteration, not per action or in the optimizer step."""
    gpu = _FakeGPU()
    schedule = _traced_schedule_on_fake_gpu(tmp_path, monkeypatch, gpu)
    syncs_at_start = gpu.syncs
    truth = _run_on_fake_gpu(schedule, gpu, iterations=3)
    (trace,) = load(str(tmp_path))
    events = trace.events
    for it, device in enumerate(truth, start=1):
        got = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e["args"]["iteration"] == it and e["cat"] in ("compute", "wait")]
        assert [e[0] for e in got] == [d[0] for d in device["actions"]]
        recv = [(e[1], e[2]) for e in got if e[0] == "recv"]
        assert recv and [f - s for s, f in recv] == [RECV_US] * len(recv)  # host time says 2 us
        assert [g[1:] for g in got] == [_at(d[1:]) for d in device["actions"]]  # device durations and timestamps
        (window,) = [e for e in events if e["cat"] == "iteration" and e["args"]["iteration"] == it]
        assert (window["ts"], window["ts"] + window["dur"]) == _at((device["start"], device["end"]))
    optimizer = [e for e in events if e["cat"] == "optimizer"]  # the last one is written by close()
    assert [(e["ts"], e["ts"] + e["dur"]) for e in optimizer] == [_at(d["optimizer"]) for d in truth[:2]]
    assert trace.meta["clock"] == "cuda_event" and trace.meta["device_type"] == "cuda"
    assert gpu.syncs - syncs_at_start == 3  # one per iteration, none in the optimizer step

    # the readers: measured busy / wait / costs and schedule_timeline --from-trace are the device's
    m = measure([trace])
    n_recv = sum(1 for d in truth[0]["actions"] if d[0] == "recv")
    busy_us = sum(COST_US[d[0]] for d in truth[0]["actions"] if d[0] in COST_US)
    assert m.clock == "cuda_event" and m.clock_warning is None
    assert m.ranks[0].busy_s == pytest.approx(2 * busy_us * 1e-6)
    assert m.ranks[0].wait_s == pytest.approx(2 * n_recv * RECV_US * 1e-6)
    assert m.mean_cost_s == pytest.approx({k: v * 1e-6 for k, v in COST_US.items() if k in m.mean_cost_s})
    assert set(m.mean_cost_s) == {"forward", "loss", "backward_input", "backward_weight"}
    assert schedule_timeline.main(["--from-trace", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clock"] == "cuda_event" and out["mean_cost_s"]["forward"] == pytest.approx(3000e-6)
    assert out["mean_iteration_s"] == pytest.approx((truth[1]["end"] - truth[1]["start"]) * 1e-6)


def test_last_optimizer_step_is_written_at_close_and_a_cpu_host_keeps_host_time(tmp_path, monkeypatch):
    """GPU defect guarded: the CUDA clock resolves the optimizer step's events only at the
    next iteration's write (so the step adds no host sync); the run's last step must still
    reach the file. A CPU platform keeps host time (compute time there), named as such."""
    gpu = _FakeGPU()
    schedule = _traced_schedule_on_fake_gpu(tmp_path / "gpu", monkeypatch, gpu)
    truth = _run_on_fake_gpu(schedule, gpu, iterations=2)
    schedule.tracer.close()
    optimizer = [e for e in load(str(tmp_path / "gpu"))[0].events if e["cat"] == "optimizer"]
    assert [(e["ts"], e["ts"] + e["dur"]) for e in optimizer] == [_at(d["optimizer"]) for d in truth]
    schedule.tracer.close()  # nothing pending: the file is left as it is
    assert len(load(str(tmp_path / "gpu"))[0].events) == sum(len(_rank0_actions()) + 2 for _ in truth)

    from megatron_weipipe.platform import Platform
    from megatron_weipipe.schedules.runtime.trace import ActionTracer
    from megatron_weipipe.schedules.runtime.trace_clock import HostClock, clock_for

    assert isinstance(clock_for(Platform("cpu", "gloo")), HostClock)
    tracer = ActionTracer(str(tmp_path / "cpu"), 0, "weipipe-zb", {"device_type": "cpu"},
                          clock=clock_for(Platform("cpu", "gloo")))
    for _ in range(2):
        with tracer.iteration_span():
            gpu.occupy_stream(COST_US["forward"], host_us=20)  # host time sees 20 us, the fake stream is ignored
    (t,) = load(str(tmp_path / "cpu"))
    assert t.meta["clock"] == "host" and [e["dur"] for e in t.events] == [20, 20]


def test_readers_refuse_mixed_clocks_and_warn_about_host_time_on_cuda(tmp_path, capsys):
    """GPU defect guarded: a directory (or a calibration's runs) mixing host-timed and
    CUDA-event-timed ranks compares launch times with kernel times; a CUDA run traced with
    host time (events unusable: the fallback) is no GPU calibration and says so."""
    from megatron_weipipe.schedules.timing.measured import same_clock

    _two_ranks(str(tmp_path))
    _write(str(tmp_path), 1, [_event("iteration", "iteration", 0, 10, 1)], clock="cuda_event")
    with pytest.raises(TraceError, match="mixes traces timed by clocks"):
        load(str(tmp_path))
    _two_ranks(str(tmp_path))  # host time (no clock recorded: older files), on a CUDA run
    for r in (0, 1):
        path = os.path.join(str(tmp_path), f"rank{r}.json")
        with open(path) as f:
            data = json.load(f)
        data["otherData"]["device_type"] = "cuda"
        with open(path, "w") as f:
            json.dump(data, f)
    m = measure(load(str(tmp_path)))
    assert m.clock == "host" and "kernel-launch time" in m.clock_warning
    assert schedule_timeline.main(["--from-trace", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "timed by host" in captured.out and "warning: traced with host time on a CUDA run" in captured.err
    gpu_m = measure(load(str(tmp_path)))
    gpu_m.clock = "cuda_event"
    with pytest.raises(TraceError, match="different clocks"):
        same_clock([m, gpu_m])
    assert same_clock([m, m]) == "host"


def test_cuda_platform_without_usable_events_falls_back_to_host_time_with_one_line(caplog):
    """GPU defect guarded: a CUDA platform whose events fail (here: a CPU build) must not
    crash the run; it traces with host time, says so once, and the metadata names it."""
    import logging

    from megatron_weipipe.platform import Platform
    from megatron_weipipe.schedules.runtime.trace_clock import HostClock, clock_for

    with caplog.at_level(logging.WARNING):
        clock = clock_for(Platform("cuda", "nccl"))
    assert isinstance(clock, HostClock) and clock.name == "host"
    assert len([r for r in caplog.records if "CUDA events unusable" in r.getMessage()]) == 1
