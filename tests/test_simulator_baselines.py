"""The simulator's baselines and what-if options: ZB-H1 lists, FSDP's per-layer collectives,
the floor, node-shared links, per-schedule kernel efficiency. Pure Python, no processes."""

from __future__ import annotations

import json
import shlex

import pytest

from megatron_weipipe.schedules.generate.megatron_timeline import megatron_timeline
from megatron_weipipe.schedules.timing.tick_simulator import simulate
from megatron_weipipe.schedules.check.validate import validate
from megatron_weipipe.schedules.ir.actions import Action, Kind, ScheduleError
from megatron_weipipe.schedules.generate.zb_h1 import zb_h1_timeline
from megatron_weipipe.simulator import baselines
from megatron_weipipe.simulator.cli import costs_for, main, parse_command
from megatron_weipipe.simulator.hardware import LINKS, shared_link
from megatron_weipipe.simulator.memory import peak_in_flight
from megatron_weipipe.simulator.project import simulate_run

SMALL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 4096 --micro-batch-size 1 "
         "--global-batch-size 16 --pipeline-model-parallel-size 4 --gpu a800 --link pcie4,ib-edr "
         "--gpus-per-node 2 --hidden-dropout 0 --attention-dropout 0 --bf16")


def run(extra: str):
    args, cluster, specs = parse_command(shlex.split(f"{SMALL} {extra}"))
    return {s.schedule: simulate_run(s, cluster, costs_for(args, s, cluster)) for s in specs}, args, cluster, specs


def costs_of(F, I, W):
    return {Kind.FORWARD: F, Kind.BACKWARD: I + W, Kind.BACKWARD_INPUT: I, Kind.BACKWARD_WEIGHT: W, Kind.LOSS: 0.0}


# ------------------------------------------------------------------ ZB-H1 lists

@pytest.mark.parametrize("P,N", [(2, 2), (4, 3), (4, 8), (8, 16)])
@pytest.mark.parametrize("fiw", [(1.0, 1.0, 1.0), (1.0, 1.875, 0.375)])
def test_zb_h1_is_valid_and_beats_1f1b_at_equal_costs(P, N, fiw):
    zb, one = zb_h1_timeline(P, N, fiw), megatron_timeline("1f1b", P, N)
    validate(zb)
    a, b = simulate(zb, costs_of(*fiw)), simulate(one, costs_of(*fiw))
    assert a.bubble_fraction < b.bubble_fraction - 0.02
    assert sum(a.busy) == pytest.approx(sum(b.busy))  # the same work, split
    # the same peak memory as 1F1B: no stage holds more microbatches than 1F1B's first stage
    assert max(peak_in_flight(zb)) == max(peak_in_flight(one)) == min(P, N)


def test_zb_h1_defers_weight_gradients_into_1f1b_bubbles():
    P, N = 4, 8
    zb = zb_h1_timeline(P, N)
    timing = simulate(zb, costs_of(1.0, 1.0, 1.0))
    one = simulate(megatron_timeline("1f1b", P, N), costs_of(1.0, 1.0, 1.0))
    for r in range(P - 1):
        acts = [t.action for t in timing.per_rank[r] if t.action.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)]
        order = [(a.kind, a.mb) for a in acts]
        # some W runs after the I of a later microbatch: deferred, not right after its own I
        assert any(order.index((Kind.BACKWARD_WEIGHT, m)) > order.index((Kind.BACKWARD_INPUT, m + 1))
                   for m in range(N - 1))
    # 1F1B's stages above the last idle in the cool-down; ZB-H1's finish earlier, the last no later
    ends_zb = [t[-1].end for t in timing.per_rank]
    ends_one = [t[-1].end for t in one.per_rank]
    assert timing.makespan < one.makespan
    assert all(z < o for z, o in zip(ends_zb[:-1], ends_one[:-1])) and ends_zb[-1] <= ends_one[-1]


def test_validator_catches_a_weight_gradient_before_its_input_gradient():
    zb = zb_h1_timeline(2, 2)
    acts = list(zb.ranks[0])
    i = next(k for k, a in enumerate(acts) if a.kind is Kind.BACKWARD_INPUT)
    w = next(k for k, a in enumerate(acts) if a.kind is Kind.BACKWARD_WEIGHT and a.mb == acts[i].mb)
    acts[i], acts[w] = (Action(acts[w].kind, 0, acts[i].tick, mb=acts[w].mb, chunk=acts[w].chunk),
                        Action(acts[i].kind, 0, acts[w].tick, mb=acts[i].mb, chunk=acts[i].chunk))
    with pytest.raises(ScheduleError, match="weight gradient before"):
        validate(zb.replace_ranks([acts, zb.ranks[1]]))
    missing = [a for a in zb.ranks[1] if not (a.kind is Kind.BACKWARD_WEIGHT and a.mb == 1)]
    with pytest.raises(ScheduleError, match="never runs the weight gradient"):
        validate(zb.replace_ranks([zb.ranks[0], missing]))
    with pytest.raises(ScheduleError):
        validate(zb.replace_ranks([zb.ranks[0] + (Action(Kind.BACKWARD_WEIGHT, 0, 99, mb=0, chunk=0),),
                                   zb.ranks[1]]))


# ------------------------------------------------------------------ FSDP, floor

def test_fsdp_moves_per_unit_gathers_and_reduce_scatters():
    res, args, cluster, specs = run("--schedules fsdp")
    r, spec = res["fsdp"], specs[0]
    s = spec.shape
    assert spec.layout.pp == 1 and spec.layout.dp == 4  # the same 4 GPUs, data parallel
    n, L, N = 4, s.num_layers, spec.num_microbatches
    layer = s.layer_params(1)
    units = baselines.fsdp_units(spec)
    assert [u for u, _ in units] == ["embedding", *(f"layer {j}" for j in range(L)), "root"]
    assert sum(p for _, p in units) == s.total_params()  # every parameter in exactly one unit
    comms, link = baselines.unit_collectives(spec, cluster)
    ag, rs = comms[1]
    assert ag.payload_bytes == layer * 2 and rs.payload_bytes == layer * 4
    assert ag.wire_bytes == pytest.approx((n - 1) / n * layer * 2)
    assert link.name == "ib-edr"  # 4 GPUs on nodes of 2: the ring leaves the node
    # every unit gathered twice (forward, backward) and reduce-scattered once per microbatch
    want = N * (n - 1) / n * s.total_params() * (2 * 2 + 4)
    assert r.bytes_per_link[0]["ib-edr"] == pytest.approx(want)
    assert r.counter[0] == {baselines.FSDP_KIND: int(want)}
    # compute-bound with free links: N x (embedding, L layers forward and backward, head)
    free, _, _, _ = run("--schedules fsdp --inter-bandwidth-gbs 1e9 --inter-latency-us 0")
    c = costs_for(args, spec, cluster)
    m = c.for_layers(1).module
    compute = N * (L * (m.forward + m.backward) + c.embed_forward + c.embed_backward + c.head_forward
                   + c.head_backward)
    assert free["fsdp"].pipeline_s == pytest.approx(compute, rel=1e-6)
    # link-bound on a slow link: at least every gather back to back
    slow, _, _, _ = run("--schedules fsdp --inter-bandwidth-gbs 0.01")
    gathers = sum(a.wire_bytes for a, _ in comms) / 0.01e9
    assert slow["fsdp"].pipeline_s > N * 2 * gathers > compute


def test_fsdp_fixed_costs_are_paid_per_unit_and_pass():
    from dataclasses import replace

    from megatron_weipipe.simulator.project import simulate_run

    _, args, cluster, specs = run("--schedules fsdp --inter-bandwidth-gbs 1e9 --inter-latency-us 0")
    spec = specs[0]
    c = costs_for(args, spec, cluster)
    plain = simulate_run(spec, cluster, c)
    U, N = spec.shape.num_layers + 2, spec.num_microbatches
    fixed = simulate_run(spec, cluster, replace(c, fsdp_unit_forward=1e-3, fsdp_unit_backward=3e-3, fsdp_step=0.25))
    assert fixed.pipeline_s - plain.pipeline_s == pytest.approx(N * U * 4e-3, rel=1e-9)
    assert fixed.iteration_s - fixed.pipeline_s == 0.25


def test_fsdp_kind_is_the_trainers():
    from megatron_weipipe.model.fsdp import FSDP_KIND

    assert baselines.FSDP_KIND == FSDP_KIND


def test_floor_is_n_times_the_slowest_stage():
    res, args, cluster, specs = run("--schedules 1f1b,zb-h1,floor --vocab-size 512")
    spec = specs[2]
    c = costs_for(args, spec, cluster)
    m = c.module
    N = spec.num_microbatches
    last = m.forward + m.backward + c.head_forward + c.head_backward
    first = m.forward + m.backward + c.embed_forward + c.embed_backward
    assert res["floor"].pipeline_s == pytest.approx(N * max(first, last), rel=1e-9)
    assert res["floor"].iteration_s < res["zb-h1"].iteration_s < res["1f1b"].iteration_s


# ------------------------------------------------------------------ what-if options

def test_shared_link_divides_bandwidth():
    ib = LINKS["ib"]
    assert shared_link(ib, 8).bandwidth_gbs == pytest.approx(ib.bandwidth_gbs / 8)
    assert shared_link(ib, 8).latency_us == ib.latency_us and shared_link(ib, 1) is ib
    alone, _, c1, _ = run("--schedules 1f1b")
    shared, _, c2, _ = run("--schedules 1f1b --inter-link-shared-by 2 --intra-link-shared-by 2")
    assert c2.inter.bandwidth_gbs == pytest.approx(c1.inter.bandwidth_gbs / 2)
    assert c2.intra.bandwidth_gbs == pytest.approx(c1.intra.bandwidth_gbs / 2)
    t1 = [t for t in alone["1f1b"].trace.transfers if t.link == "ib-edr"][0]
    t2 = [t for t in shared["1f1b"].trace.transfers if t.link == "ib-edr/2"][0]
    assert (t2.end - t2.start) > 1.9 * (t1.end - t1.start) - 1e-5


def test_kernel_efficiency_scales_one_schedules_compute():
    base, *_ = run("--schedules 1f1b,weipipe-interleave")
    slow, *_ = run("--schedules 1f1b,weipipe-interleave --kernel-efficiency weipipe-interleave=0.5")
    w0, w1 = base["weipipe-interleave"].trace.work, slow["weipipe-interleave"].trace.work
    assert all(b == pytest.approx(2 * a) for a, b in zip(w0, w1))
    assert slow["weipipe-interleave"].iteration_s > 1.5 * base["weipipe-interleave"].iteration_s
    assert slow["1f1b"].iteration_s == base["1f1b"].iteration_s
    everyone, *_ = run("--schedules 1f1b --kernel-efficiency 0.5")
    assert everyone["1f1b"].iteration_s > base["1f1b"].iteration_s


@pytest.mark.parametrize("extra,needle", [
    ("--kernel-efficiency fast", "--kernel-efficiency"),
    ("--kernel-efficiency interleaved=0.5 --schedules 1f1b", "--kernel-efficiency"),
    ("--kernel-efficiency 0", "--kernel-efficiency"),
    ("--inter-link-shared-by 3", "shared-by"),
    ("--schedules zb-h2", "--schedules"),
])
def test_bad_baseline_options_are_one_line(capsys, extra, needle):
    assert main(shlex.split(f"{SMALL} {extra}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


# ------------------------------------------------------------------ testbed rows

def _shape():
    from megatron_weipipe.simulator.testbed import TestbedShape

    return TestbedShape(layers=4, hidden=128, heads=4, microbatches=4)


def _calibration(seq, layer_f=0.01, layer_b=0.02):
    from megatron_weipipe.simulator.calibration import ChunkTimes, HostCalibration
    ct = ChunkTimes(2, 2 * layer_f, 2 * layer_b, 2 * layer_b * 0.7, 2 * layer_b * 0.3)
    return HostCalibration(shape=_shape().model(seq), module=ct, flat=ct, embed_forward=1e-3,
                           embed_backward=2e-3, head_forward=3e-3, head_backward=4e-3, optimizer_per_param=0.0,
                           repeats=1)


def test_testbed_row_prediction_follows_the_link_and_the_costs():
    from megatron_weipipe.simulator.testbed import TESTBED_SCHEDULES, compare_rows, predict_testbed_row

    seq, cal = 1024, _calibration(1024)
    fast = {n: predict_testbed_row(n, seq, 1e15, 0.0, cal, _shape()) for n in TESTBED_SCHEDULES}
    slow = {n: predict_testbed_row(n, seq, 1e6, 1e-3, cal, _shape()) for n in TESTBED_SCHEDULES}
    # free link, the last stage (layers + head) the slower: stage 0's first F, then N x the
    # last stage's F + B, then stage 0's last B
    f0, b0, f1, b1 = 0.02 + 1e-3, 0.04 + 2e-3, 0.02 + 3e-3, 0.04 + 4e-3
    want = f0 + 4 * (f1 + b1) + b0
    assert fast["1f1b"].iteration_s == pytest.approx(want, rel=1e-6)
    for n in TESTBED_SCHEDULES:  # every row slows down on a slow link, by at least its bytes / rate
        sent = max(sum(d.values()) for d in slow[n].bytes_per_link)
        assert slow[n].iteration_s > fast[n].iteration_s + 0.5 * sent / 1e6
    # activations: 4 microbatches x seq x hidden x fp32 each way through 1F1B's one hop
    assert fast["1f1b"].counter[0]["activations"] == 4 * seq * 128 * 4
    rows = [{"preset": "ib-edr", "seq": seq, "schedule": n, "tokens_per_s": fast[n].tokens_per_s * 1.1,
             "bytes_sent": 1} for n in ("1f1b", "weipipe-interleave")]
    out = compare_rows(rows, {("ib-edr", seq, 4, n): fast[n].tokens_per_s for n in ("1f1b", "weipipe-interleave")})
    assert all(r["error"] == pytest.approx(1 / 1.1 - 1) and r["order_matches"] for r in out)
    for r in rows:  # measured in the reverse order of the prediction
        r["tokens_per_s"] = 1.0 / fast[r["schedule"]].tokens_per_s
    assert not any(r["order_matches"] for r in compare_rows(rows, {k: v for k, v in (
        (("ib-edr", seq, 4, n), fast[n].tokens_per_s) for n in ("1f1b", "weipipe-interleave"))}))
    with pytest.raises(Exception, match="calibration is of"):
        predict_testbed_row("1f1b", 2048, 1e9, 0.0, cal, _shape())


def test_testbed_fsdp2_option_rows_send_what_the_trainer_sends():
    """The FSDP2 rows' predicted bytes follow the identities the testbed smoke measures
    (tests/test_link_testbed.py): per unit, G microbatches per rank, plain G(2A + R), no
    reshard and one sync GA + R; one sync alone equals plain at G = 1 and is faster at G = 2."""
    from dataclasses import replace

    from megatron_weipipe.simulator.testbed import predict_testbed_row

    seq, cal = 1024, _calibration(1024)

    def row(name, mb):
        return predict_testbed_row(name, seq, 1e8, 0.0, cal, replace(_shape(), microbatches=mb))

    sent = {(n, mb): row(n, mb).counter[0]["fsdp"] for n in ("fsdp", "fsdp-no-reshard-sync-once", "fsdp-sync-once")
            for mb in (2, 4)}
    assert sent["fsdp", 4] == 2 * sent["fsdp", 2]
    assert sent["fsdp-no-reshard-sync-once", 4] - sent["fsdp-no-reshard-sync-once", 2] \
        == sent["fsdp", 2] - sent["fsdp-no-reshard-sync-once", 2] > 0
    assert sent["fsdp-sync-once", 2] == sent["fsdp", 2] and sent["fsdp-sync-once", 4] < sent["fsdp", 4]
    assert row("fsdp-sync-once", 4).iteration_s < row("fsdp", 4).iteration_s


def test_testbed_row_takes_the_measured_fixed_costs():
    from megatron_weipipe.simulator.calibration import Fsdp2Overhead
    from megatron_weipipe.simulator.testbed import predict_testbed_row

    seq, cal, shape = 1024, _calibration(1024), _shape()
    plain = {n: predict_testbed_row(n, seq, 1e15, 0.0, cal, shape) for n in ("1f1b", "fsdp")}
    # a message's wait is a latency on every point-to-point hop: 1F1B's 2 x N blocking hops
    # that are on its critical path at least once each way
    waited = predict_testbed_row("1f1b", seq, 1e15, 0.0, cal, shape, message_s=0.01)
    assert waited.iteration_s >= plain["1f1b"].iteration_s + 2 * 0.01
    # FSDP2's costs: per unit (embedding, 4 layers, root) and pass, each of the 2 microbatches
    # a rank runs, then its step; the message wait is inside them and not added again
    over = Fsdp2Overhead(unit_forward_s=1e-3, unit_backward_s=2e-3, step_s=0.05)
    fsdp = predict_testbed_row("fsdp", seq, 1e15, 0.0, cal, shape, fsdp2=over, message_s=0.01)
    assert fsdp.pipeline_s - plain["fsdp"].pipeline_s == pytest.approx(2 * 6 * 3e-3, rel=1e-6)
    assert fsdp.iteration_s - fsdp.pipeline_s == pytest.approx(0.05)
    # the training loop's own time per iteration: added to the point-to-point rows, not to
    # FSDP's, whose measured step holds it
    looped = predict_testbed_row("1f1b", seq, 1e15, 0.0, cal, shape, loop_s=0.004)
    assert looped.iteration_s == pytest.approx(plain["1f1b"].iteration_s + 0.004)
    assert looped.tokens_per_s * looped.iteration_s == pytest.approx(plain["1f1b"].tokens_per_s * plain["1f1b"].iteration_s)
    assert predict_testbed_row("fsdp", seq, 1e15, 0.0, cal, shape, fsdp2=over, message_s=0.01,
                               loop_s=0.004).iteration_s == pytest.approx(fsdp.iteration_s)
    # a token bucket passes what it saved at once on a slow link, for 1F1B's activations
    # and FSDP's gathers alike
    for name in ("1f1b", "fsdp"):
        slow = predict_testbed_row(name, seq, 1e6, 0.0, cal, shape)
        burst = predict_testbed_row(name, seq, 1e6, 0.0, cal, shape, burst_bytes=64 * 1024)
        assert burst.iteration_s < slow.iteration_s, name


def test_order_counts_only_pairs_the_rounds_separate():
    from megatron_weipipe.simulator.testbed import order_matches

    measured = {"a": (100.0, 95.0, 105.0), "b": (101.0, 99.0, 103.0), "c": (200.0, 190.0, 210.0)}
    # a and b overlap: a tie either way; c is measured fastest and must be predicted so
    assert order_matches(measured, {"a": 2.0, "b": 1.0, "c": 3.0})
    assert order_matches(measured, {"a": 1.0, "b": 2.0, "c": 3.0})
    assert not order_matches(measured, {"a": 1.0, "b": 4.0, "c": 3.0})
    # single rounds: every pair is ordered by the measurement
    assert not order_matches({"a": (1.0, 1.0, 1.0), "b": (1.01, 1.01, 1.01)}, {"a": 2.0, "b": 1.0})
    # predictions from several calibration sets: a pair whose predicted ranges overlap is a
    # tie the calibrations cannot break; separated ranges must agree with the measurement
    one = {"a": (1.0, 1.0, 1.0), "b": (1.5, 1.5, 1.5)}
    assert order_matches(one, {"a": (2.0, 1.4, 2.1), "b": (1.6, 1.5, 1.7)})
    assert not order_matches(one, {"a": (2.0, 1.9, 2.1), "b": (1.6, 1.5, 1.7)})


def test_testbed_compare_bad_input_is_one_line(tmp_path, capsys):
    from tools.simulator_validation import testbed_compare

    bad = tmp_path / "rows.json"
    bad.write_text('{"not": "a list"}')
    for path in (tmp_path / "missing.json", bad):
        assert testbed_compare.main(["--testbed-json", str(path), "--flops", "1e10"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ")


def test_testbed_compare_predicts_from_the_in_run_calibration(tmp_path, capsys):
    """A --save file's in-run layer timings replace the directory's, rank by rank; the
    optimizer step and the training loop's time still come from the directory; --no-in-run
    ignores the in-run timings, --no-loop the loop's."""
    from dataclasses import replace

    from megatron_weipipe.simulator import calibration as calib
    from tools.simulator_validation import testbed_compare

    seq, shape = 1024, _shape()
    cal_dir = tmp_path / "cal"
    cal_dir.mkdir()
    directory = replace(_calibration(seq), optimizer_per_param=1e-6)
    calib.save(directory, str(cal_dir / f"testbed-L{shape.layers}-h{shape.hidden}-a{shape.heads}-s{seq}.json"))
    (cal_dir / f"loop-L{shape.layers}-h{shape.hidden}-a{shape.heads}.json").write_text('{"seconds": 0.01}')
    slow = [_calibration(seq, layer_f=0.02, layer_b=0.04), _calibration(seq, layer_f=0.03, layer_b=0.06)]
    rows = [{"preset": "ib-edr", "seq": seq, "schedule": n, "tokens_per_s": 1000.0, "tokens_per_s_rounds": [1000.0],
             "bytes_sent": 1, "layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads}
            for n in ("1f1b", "weipipe-interleave")]
    saved = tmp_path / "sweep.json"
    saved.write_text(json.dumps({"rows": rows, "flops": 1e15, "notes": [], "calibrations": {  # a fast link
        "ib-edr": {str(seq): [json.loads(c.to_json()) for c in slow]}}}))

    def predicted(*extra):
        argv = ["--testbed-json", str(saved), "--calibration-dir", str(cal_dir), "--message-delay-us", "0", *extra]
        assert testbed_compare.main(argv) == 0
        out = capsys.readouterr().out
        table = {line.split("|")[4].strip(): line.split("|")[6] for line in out.splitlines()
                 if line.startswith("| ib-edr")}
        return out, {k: float(v.split("[")[0]) for k, v in table.items()}, {k: v for k, v in table.items()}

    out, in_run, ranges = predicted()
    assert "layer timings in-run (1 preset-sequences, each rank)" in out
    _, dirs, _ = predicted("--no-in-run")
    for name in in_run:  # the in-run layers are 2x-3x the directory's: every row predicted slower
        assert in_run[name] < 0.75 * dirs[name], (name, in_run, dirs)
        lo, hi = (float(x) for x in ranges[name].split("[")[1].split("]")[0].split(","))
        assert lo < in_run[name] < hi  # the two ranks' timings differ: a range, the mean inside it
    out, unlooped, _ = predicted("--no-loop")
    assert "training loop 10.00 ms per iteration" in predicted()[0] and "training loop 0.00 ms" in out
    tokens = 4 * seq  # the global batch: 10 ms more per iteration than without the loop
    for name in in_run:
        assert tokens / in_run[name] == pytest.approx(tokens / unlooped[name] + 0.01, rel=1e-3), name
    other = json.loads(saved.read_text())
    other["calibrations"]["ib-edr"][str(seq)] = [json.loads(_calibration(2048).to_json())] * 2
    saved.write_text(json.dumps(other))
    assert testbed_compare.main(["--testbed-json", str(saved), "--calibration-dir", str(cal_dir),
                                 "--message-delay-us", "0"]) == 2
    assert "in-run calibration is of another shape" in capsys.readouterr().err


def test_testbed_compare_spans_the_fsdp2_probes_rounds(tmp_path, capsys):
    """An FSDP row is predicted from the probe's medians, and its range from each round of
    the probe on its own: the spread of FSDP2's fixed costs is part of the calibration's."""
    from megatron_weipipe.simulator import calibration as calib
    from megatron_weipipe.simulator.calibration import Fsdp2Overhead
    from tools.simulator_validation import testbed_compare

    seq, shape = 1024, _shape()
    name = f"L{shape.layers}-h{shape.hidden}-a{shape.heads}"
    cal_dir = tmp_path / "cal"
    cal_dir.mkdir()
    calib.save(_calibration(seq), str(cal_dir / f"testbed-{name}-s{seq}.json"))
    (cal_dir / f"loop-{name}.json").write_text('{"seconds": 0.0}')
    rows = [{"preset": "ib-edr", "seq": seq, "schedule": "fsdp", "tokens_per_s": 1000.0,
             "tokens_per_s_rounds": [1000.0], "bytes_sent": 1, "layers": shape.layers, "hidden": shape.hidden,
             "heads": shape.heads}]
    saved = tmp_path / "sweep.json"
    saved.write_text(json.dumps({"rows": rows, "flops": 1e15, "notes": []}))

    def predicted(over: Fsdp2Overhead) -> tuple[float, float, float]:
        (cal_dir / f"fsdp2-{name}.json").write_text(over.to_json())
        assert testbed_compare.main(["--testbed-json", str(saved), "--calibration-dir", str(cal_dir),
                                     "--message-delay-us", "0"]) == 0
        cell = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| ib-edr")).split("|")[6]
        lo, hi = (float(x) for x in cell.split("[")[1].split("]")[0].split(","))
        return float(cell.split("[")[0]), lo, hi

    fast, slow = (1e-3, 2e-3, 0.05), (3e-3, 6e-3, 0.07)
    median = Fsdp2Overhead(2e-3, 4e-3, 0.06, rounds=(fast, slow))
    point, lo, hi = predicted(median)
    assert predicted(Fsdp2Overhead(2e-3, 4e-3, 0.06)) == (point, point, point)  # no rounds recorded: one set
    assert predicted(Fsdp2Overhead(*slow))[0] == lo and predicted(Fsdp2Overhead(*fast))[0] == hi
    assert lo < point < hi
