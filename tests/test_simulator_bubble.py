"""The event replay over the real action lists gives the closed-form bubbles when
communication is free, and transfers, posting rules and shared cores where it is not."""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_weipipe.schedules.generate.megatron_timeline import build
from megatron_weipipe.schedules.ir.actions import Kind
from megatron_weipipe.schedules.timing.closed_forms import expected_bubble
from megatron_weipipe.schedules.timing.tick_simulator import DEFAULT_COSTS, simulate
from megatron_weipipe.simulator.calibration import ChunkTimes
from megatron_weipipe.simulator.costs import CostModel
from megatron_weipipe.errors import SimulatorError
from megatron_weipipe.simulator.cluster_replay import EventModel, replay
from megatron_weipipe.simulator.hardware import Cluster, DEVICES, LinkSpec
from megatron_weipipe.simulator.rank_order import Layout
from megatron_weipipe.simulator.project import simulate_run
from megatron_weipipe.simulator.run_spec import RunSpec
from megatron_weipipe.shape import ModelShape

FREE = LinkSpec("free", 1e12, 0.0)
ALL = ("1f1b", "interleaved", "weipipe-naive", "weipipe-interleave", "weipipe-zb")


def _model(schedule, costs=DEFAULT_COSTS, link=FREE, nbytes=0, **kw):
    semantics = "blocking" if schedule.name == "1f1b" else "async"
    return EventModel(duration=lambda a: costs.get(a.kind, 0.0), message_bytes=lambda a: nbytes,
                      link=lambda a, b: link, semantics=semantics, **kw)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("P,G", [(2, 1), (3, 2), (4, 2), (4, 4), (6, 3)])
def test_replay_equals_the_schedule_simulator_without_comm(name, P, G):
    s = build(name, P, G)
    ref = simulate(s)
    got = replay(s, _model(s))
    assert got.makespan == pytest.approx(ref.makespan, abs=1e-9)
    assert got.bubble_fraction == pytest.approx(ref.bubble_fraction, abs=1e-9)


@pytest.mark.parametrize("name", ["weipipe-naive", "weipipe-interleave", "weipipe-zb"])
@pytest.mark.parametrize("P,G", [(2, 1), (4, 2), (5, 3), (8, 2)])
def test_weipipe_closed_forms(name, P, G):
    got = replay(build(name, P, G), _model(build(name, P, G))).bubble_fraction
    assert got == pytest.approx(float(expected_bubble(name, P, G)), abs=1e-12)


@pytest.mark.parametrize("P,N", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_1f1b_equal_forward_and_backward_gives_textbook_bubble(P, N):
    s = build("1f1b", P, 1, N=N)
    got = replay(s, _model(s, {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.0})).bubble_fraction
    assert got == pytest.approx(float(Fraction(P - 1, N + P - 1)), abs=1e-12)


def _equal_costs(f: float) -> CostModel:
    chunk = ChunkTimes(1, f, f, f / 2, f / 2)
    return CostModel(chunk, chunk, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("P,N", [(2, 4), (4, 8)])
def test_projection_with_free_links_gives_the_closed_form(P, N):
    shape = ModelShape(num_layers=P, hidden_size=64, num_attention_heads=4, seq_length=32)
    cluster = Cluster(device=DEVICES["h100"], intra=FREE, inter=FREE)
    spec = RunSpec(shape, Layout(pp=P), global_batch_size=N, schedule="1f1b")
    r = simulate_run(spec, cluster, _equal_costs(0.01))
    assert r.bubble == pytest.approx((P - 1) / (N + P - 1), abs=1e-9)
    assert r.pipeline_s == pytest.approx(0.01 * 2 * (N + P - 1), rel=1e-9)


def test_a_transfer_costs_latency_plus_bytes_over_bandwidth():
    s = build("1f1b", 2, 1, N=1)
    link = LinkSpec("slow", 1.0, 10.0)  # 1 GB/s, 10 us
    tr = replay(s, _model(s, {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.0}, link=link, nbytes=10**6))
    hop = 10e-6 + 1e-3
    assert tr.makespan == pytest.approx(4.0 + 2 * hop)
    assert [t.end - t.start for t in tr.transfers] == pytest.approx([hop, hop])


def test_a_token_bucket_passes_what_it_saved_at_once():
    from megatron_weipipe.schedules.timing.replay import TokenBucket

    b = TokenBucket(rate=1e6, depth=1e5)  # 1 MB/s, 100 kB bucket, full at the start
    assert b.seconds(0.0, 3e5) == pytest.approx(0.2)  # 100 kB at once, 200 kB at the rate
    assert b.seconds(0.2, 5e4) == pytest.approx(0.05)  # right after: the bucket is empty
    assert b.seconds(10.0, 5e4) == 0.0  # idle long enough: full again, capped at its depth
    assert b.seconds(10.0, 1e5) == pytest.approx(0.05)  # 50 kB left, 50 kB at the rate
    # in the replay: each 1 MB hop of a 1 GB/s link with a 0.5 MB bucket after an idle second
    s = build("1f1b", 2, 1, N=1)
    shaped = LinkSpec("shaped", 1.0, 0.0, burst_bytes=5e5)
    tr = replay(s, _model(s, {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.0}, link=shaped, nbytes=10**6))
    assert [t.end - t.start for t in tr.transfers] == pytest.approx([0.5e-3, 0.5e-3])
    assert tr.makespan == pytest.approx(4.0 + 1e-3)


def test_blocking_sends_wait_for_the_receiver_async_sends_do_not():
    s = build("1f1b", 2, 1, N=4)
    slow = LinkSpec("slow", 1.0, 0.0)
    blocking = replay(s, _model(s, link=slow, nbytes=10**8)).makespan
    m = _model(s, link=slow, nbytes=10**8)
    m.semantics = "async"
    assert replay(s, m).makespan < blocking


def test_messages_between_one_pair_queue_behind_each_other():
    s = build("weipipe-interleave", 2, 2)
    link = LinkSpec("slow", 1.0, 0.0)
    tr = replay(s, _model(s, {k: 0.0 for k in Kind}, link=link, nbytes=10**8))
    by_pair: dict = {}
    for t in tr.transfers:
        by_pair.setdefault((t.src, t.dst), []).append(t)
    for ts in by_pair.values():
        ts.sort(key=lambda t: t.start)
        for a, b in zip(ts, ts[1:]):
            assert b.start >= a.end - 1e-12


def test_ranks_sharing_one_core_run_at_half_speed():
    s = build("weipipe-interleave", 2, 1)
    alone = replay(s, _model(s)).makespan
    shared = replay(s, _model(s, host_of=lambda r: 0, cores_per_host=1.0)).makespan
    # every tick both ranks compute except the fill and drain ticks
    assert alone < shared <= 2 * alone + 1e-9


def test_unmatched_lists_are_an_error():
    s = build("1f1b", 2, 1, N=2)
    ranks = [list(r) for r in s.ranks]
    ranks[1] = [a for a in ranks[1] if a.kind is not Kind.RECV]
    with pytest.raises(SimulatorError):
        replay(s.replace_ranks(ranks), _model(s))


@pytest.mark.parametrize("name", ["1f1b", "weipipe-interleave"])
def test_host_cpu_of_messages_is_charged_to_both_ends(name):
    s = build(name, 2, 2)
    costly = LinkSpec("gloo", 1e3, 0.0, cpu_s_per_byte=1e-9)
    free = replay(s, _model(s, link=FREE, nbytes=10**6))
    paid = replay(s, _model(s, link=costly, nbytes=10**6))
    messages = sum(1 for a in s.all_actions() if a.kind is Kind.SEND)
    assert sum(paid.work) - sum(free.work) == pytest.approx(messages * 1e-3)
    assert paid.makespan > free.makespan


def test_background_load_from_what_the_calibrators_saw():
    from megatron_weipipe.simulator.calibration import background_tasks

    # saturated: 2 calibrators got half a core each on 2 cores -> 4 runnable, 2 of them others
    assert background_tasks(0.5, 2.0, 2, processes=2) == pytest.approx(2.0)
    # idle host: each calibrator had a core; the sibling is not background
    assert background_tasks(1.0, 1.0, 2, processes=2) == pytest.approx(0.0)
    assert background_tasks(1.0, 0.5, 4, processes=1) == pytest.approx(0.5)
