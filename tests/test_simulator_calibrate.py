"""One tiny calibration on this host (in-process: real megatron-core layers on the CPU),
its JSON round trip, and how chunk times scale to other layer counts. No times asserted
beyond being positive."""

from __future__ import annotations

import pytest

from megatron_weipipe.schedules.generate.megatron_timeline import build
from megatron_weipipe.schedules.ir.actions import Kind
from megatron_weipipe.training.host_calibration import calibrate
from megatron_weipipe.simulator.calibration import ChunkTimes, HostCalibration
from megatron_weipipe.simulator.costs import from_calibration, scale_chunk
from megatron_weipipe.shape import ModelShape

TINY = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  vocab_size=200)


@pytest.fixture(scope="module")
def cal():
    return calibrate(TINY, 1, repeats=1)


def test_every_measured_time_is_positive(cal):
    for chunk in (cal.module, cal.flat):
        assert chunk.layers == 1
        assert min(chunk.forward, chunk.backward, chunk.backward_input, chunk.backward_weight) > 0
    assert min(cal.embed_forward, cal.embed_backward, cal.head_forward, cal.head_backward) > 0
    assert cal.optimizer_per_param > 0


def test_json_round_trip(cal):
    assert HostCalibration.from_json(cal.to_json()) == cal


def test_costs_follow_the_actions(cal):
    costs = from_calibration(cal, 2)
    zb = costs.duration(build("weipipe-zb", 2, 1))
    fwd0 = [a for a in build("weipipe-zb", 2, 1).ranks[0] if a.kind is Kind.FORWARD and a.chunk == 0][0]
    assert zb(fwd0) == pytest.approx(2 * cal.flat.forward + cal.embed_forward)


def test_weight_pass_scales_with_a_full_backward_per_extra_layer():
    t = ChunkTimes(1, 1.0, 3.0, 2.0, 1.5)
    s = scale_chunk(t, 4)
    assert (s.forward, s.backward, s.backward_input) == (4.0, 12.0, 8.0)
    assert s.backward_weight == pytest.approx(1.5 + 3 * 3.0)


def test_calibrations_average_field_by_field():
    from dataclasses import replace

    from megatron_weipipe.simulator.calibration import ChunkTimes, Fsdp2Overhead, HostCalibration, mean_of
    from megatron_weipipe.shape import ModelShape

    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=64, vocab_size=259)
    a = HostCalibration(shape=shape, module=ChunkTimes(1, 1.0, 2.0, 1.5, 0.5), flat=ChunkTimes(1, 3.0, 4.0, 3.0, 1.0),
                        embed_forward=0.1, embed_backward=0.2, head_forward=0.3, head_backward=0.4,
                        optimizer_per_param=1e-8, repeats=3)
    b = replace(a, module=ChunkTimes(1, 3.0, 4.0, 2.5, 1.5), head_forward=0.5, optimizer_per_param=3e-8)
    m = mean_of([a, b])
    assert m.module == ChunkTimes(1, 2.0, 3.0, 2.0, 1.0) and m.flat == a.flat
    assert m.head_forward == pytest.approx(0.4) and m.optimizer_per_param == pytest.approx(2e-8)
    with pytest.raises(ValueError):
        mean_of([a, replace(b, shape=replace(shape, seq_length=128))])
    f = Fsdp2Overhead.mean_of([Fsdp2Overhead(1.0, 2.0, 3.0), Fsdp2Overhead(3.0, 4.0, 5.0)])
    assert f == Fsdp2Overhead(2.0, 3.0, 4.0)
    # a probe's rounds travel with it, through JSON and into the mean; without them, one set
    probe = Fsdp2Overhead(1.0, 2.0, 3.0, rounds=((0.5, 1.5, 3.0), (1.5, 2.5, 3.0)))
    assert Fsdp2Overhead.from_json(probe.to_json()) == probe
    assert probe.each_round() == [Fsdp2Overhead(0.5, 1.5, 3.0), Fsdp2Overhead(1.5, 2.5, 3.0)]
    assert f.each_round() == [f] and Fsdp2Overhead.from_json('{"unit_forward_s": 1, "unit_backward_s": 2, '
                                                             '"step_s": 3}') == Fsdp2Overhead(1, 2, 3)
    assert Fsdp2Overhead.mean_of([probe, f]).rounds == probe.rounds


def test_calibration_rounds_go_on_while_under_min_seconds():
    """A short sequence's timings are milliseconds each: the calibration keeps timing rounds
    until they add up to min_seconds, up to a cap; without it, exactly `repeats`."""
    from megatron_weipipe.training import host_calibration

    calls = []
    probes = {"p": lambda: calls.append(1) or {"x": (1.0, 1.0)}}
    assert len(host_calibration._rounds(probes, 3)["p.x"]) == 3
    # instant rounds never reach a minute: the cap stops them
    assert len(host_calibration._rounds(probes, 2, min_seconds=60.0, most=7)["p.x"]) == 7
    assert len(calls) == 1 + 3 + 1 + 7  # one warm-up call per _rounds
