"""Measured busy, idle and bubble from per-action traces (plan/measured.py and
tools/schedule_timeline.py --from-trace), on hand-made traces with known answers. The
end-to-end check (real runs writing traces) is test_weipipe_gpt_parity.py's
test_schedule_trace_has_every_action_of_the_plan."""

from __future__ import annotations

import json
import os

import pytest
import schedule_timeline  # tools/

from megatron_weipipe.schedules.plan.measured import TraceError, between_iterations_s, load, measure


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
    from megatron_weipipe.schedules.plan import generate
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
