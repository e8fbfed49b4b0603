"""WeiPipe schedules as data: every schedule validates for P in 2..8, G in 1..4 (no
process group), the interleave timeline is WEIPIPE.md's, and the metrics equal their
closed forms."""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Flow, Kind, ScheduleError
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.check.validate import validate
from megatron_weipipe.schedules.timing.closed_forms import (
    bubble_fraction,
    expected_bubble,
    expected_messages,
    expected_ring_totals,
    expected_ticks,
    idle_ticks,
    message_counts,
    received_counts,
    traffic,
    weipipe_message_sizes,
)
from megatron_weipipe.schedules.timing.tick_simulator import simulate
from megatron_weipipe.schedules.generate.megatron_timeline import build, megatron_timeline, tick_table

SCHEDULES = registry.weipipe_names()

GRID = [(P, G) for P in range(2, 9) for G in range(1, 5)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_validates(name):
    for P, G in GRID:
        validate(generate(name, P, G))


def test_interleave_table_is_the_design_note_timeline():
    # WEIPIPE.md, P=4, G=2, 1-indexed ticks; our ticks are 0-indexed
    doc = {
        1: ["F0.s0", "-", "-", "-"],
        5: ["B0.s3+F1.s0", "F0.s3", "F0.s2", "F0.s1"],
        8: ["B0.s0+F1.s3", "B0.s1+F1.s2", "B0.s2+F1.s1", "B0.s3+F1.s0"],
        9: ["B1.s3", "B0.s0+F1.s3", "B0.s1+F1.s2", "B0.s2+F1.s1"],
        12: ["B1.s0", "B1.s1", "B1.s2", "B1.s3"],
        15: ["-", "-", "-", "B1.s0"],
    }
    rows = tick_table(generate("weipipe-interleave", 4, 2)).splitlines()[2:]
    assert len(rows) == 15
    for t, cells in doc.items():
        assert rows[t - 1] == f"| {t - 1} | " + " | ".join(cells) + " |"


def test_interleave_pairs_forward_s_with_backward_p_minus_1_minus_s():
    P, G = 5, 3
    for rank_actions in generate("weipipe-interleave", P, G).ranks:
        by_tick = {}
        for a in rank_actions:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD):
                by_tick.setdefault(a.tick, {})[a.kind] = a.chunk
        paired = [d for d in by_tick.values() if len(d) == 2]
        assert paired and all(d[Kind.FORWARD] == P - 1 - d[Kind.BACKWARD] for d in paired)


def test_first_tick_needs_placement_exchange_as_explicit_messages():
    P = 6
    s = generate("weipipe-interleave", P, 2)
    placed = [a for a in s.all_actions() if a.flow is Flow.PLACEMENT]
    sends = sorted((a.rank, a.peer, a.chunk) for a in placed if a.kind is Kind.SEND)
    # the rotation puts chunk c on rank -c mod P at tick 0; owners c with 2c < P send it there
    assert sends == [(c, P - c, c) for c in range(1, (P + 1) // 2)]
    assert all(a.tick == 0 for a in placed)
    # owners c with 2c >= P load their chunk when the rotation passes them
    loads = sorted((a.rank, a.tick) for a in s.all_actions()
                   if a.kind is Kind.LOAD and a.buffer.flow is Flow.FWD_WEIGHTS)
    assert loads == [(0, 0)] + [(c, 2 * c - P) for c in range((P + 1) // 2, P)]


def test_every_flow_has_its_own_tag_and_moves_one_hop_per_tick():
    s = generate("weipipe-zb", 2, 3)
    tags = {}
    for a in s.all_actions():
        if a.kind is Kind.SEND:
            tags.setdefault(a.flow, set()).add(a.tag)
            if a.flow is not Flow.PLACEMENT:
                assert a.peer == (a.rank + 1) % 2
    assert all(len(t) == 1 for t in tags.values())
    assert len({next(iter(t)) for t in tags.values()}) == len(tags)


def test_zb_splits_backward_and_weights_leave_before_weight_gradient():
    s = generate("weipipe-zb", 4, 2)
    kinds = {a.kind for a in s.all_actions()}
    assert Kind.BACKWARD not in kinds and {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT} <= kinds
    for acts in s.ranks:
        for i, a in enumerate(acts):
            if a.kind is not Kind.BACKWARD_WEIGHT:
                continue
            assert a.buffer is None  # W reads no weights
            same_tick = [b for b in acts[:i] if b.tick == a.tick]
            (inp,) = [b for b in same_tick if b.kind is Kind.BACKWARD_INPUT]
            assert (inp.mb, inp.chunk) == (a.mb, a.chunk)
            gone = [b for b in same_tick if b.kind in (Kind.SEND, Kind.DROP) and b.buffer == inp.buffer]
            assert gone, "backward weights must be sent on (or dropped) before W runs"


@pytest.mark.parametrize("name", SCHEDULES)
def test_ticks_idle_ticks_and_bubble_equal_closed_forms(name):
    for P, G in GRID:
        s = generate(name, P, G)
        assert s.num_ticks() == expected_ticks(name, P, G)
        assert idle_ticks(s) == (P - 1,) * P
        assert bubble_fraction(s) == pytest.approx(float(expected_bubble(name, P, G)), abs=1e-12)


@pytest.mark.parametrize("name", SCHEDULES)
def test_messages_per_rank_and_flow_equal_closed_forms(name):
    for P, G in GRID:
        s = generate(name, P, G)
        sent, got = message_counts(s), received_counts(s)
        for r in range(P):
            assert sent[r] == expected_messages(name, P, G, r)
            ring = {f: n for f, n in expected_messages(name, P, G, (r - 1) % P).items() if f is not Flow.PLACEMENT}
            if 1 <= (P - r) % P and 2 * ((P - r) % P) < P:
                ring[Flow.PLACEMENT] = 1
            assert got[r] == ring
        totals = {f: n for f, n in expected_ring_totals(name, P, G).items() if n}
        summed = {}
        for row in sent:
            for f, n in row.items():
                summed[f] = summed.get(f, 0) + n
        assert summed == totals


def test_interleave_bytes_per_rank_between_3GW_and_3G_plus_2_W():
    """W = P * w decoder elements; weights travel in bf16 (2 bytes), grads in fp32 (4)."""
    P, G, w = 8, 4, 1000
    s = generate("weipipe-interleave", P, G)
    elements, sizes = weipipe_message_sizes(w, weight_bytes=2, grad_bytes=4)
    for r, row in enumerate(traffic(s, elements, sizes)):
        total_elems = sum(t.elements for t in row.values())
        # between 3G*W - 3w (last rank) and 3G*W + (2P - 5)w (rank P-2): under the note's 3(G+1)W
        assert 3 * G * P * w - 3 * w <= total_elems <= 3 * G * P * w + (2 * P - 5) * w
        want = expected_messages("weipipe-interleave", P, G, r)
        assert row[Flow.GRADS].bytes == want[Flow.GRADS] * w * 4
        assert row[Flow.FWD_WEIGHTS].bytes == want[Flow.FWD_WEIGHTS] * w * 2


def test_bubble_drops_from_naive_to_interleave_to_zb_and_beats_1f1b():
    P, G = 4, 4
    got = {n: bubble_fraction(build(n, P, G)) for n in ("1f1b", "interleaved") + SCHEDULES}
    assert got["weipipe-zb"] < got["weipipe-interleave"] < got["1f1b"] < got["weipipe-naive"]
    assert got["1f1b"] == pytest.approx(3 / 19)  # (P-1)/(N+P-1), N = G*P = 16
    assert got["interleaved"] == pytest.approx(3 / 35)  # (P-1)/(V*N+P-1), V = 2
    assert got["weipipe-zb"] == pytest.approx(float(Fraction(3, 51)))


@pytest.mark.parametrize("P,N", [(1, 3), (2, 1), (4, 4), (4, 9), (5, 2), (8, 8)])
def test_1f1b_timeline_validates_with_textbook_bubble(P, N):
    s = megatron_timeline("1f1b", P, N)
    validate(s)
    assert simulate(s).makespan == 3 * (N + P - 1)
    assert s.num_ticks() == 2 * (N + P - 1)


@pytest.mark.parametrize("P,N,V", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 4)])
def test_interleaved_timeline_validates_with_textbook_bubble(P, N, V):
    s = megatron_timeline("interleaved", P, N, V)
    validate(s)
    t = simulate(s)
    assert t.bubble_fraction == pytest.approx((P - 1) / (V * N + P - 1))


def test_bad_sizes_fail_with_one_sentence():
    with pytest.raises(ScheduleError, match="at least 2 ranks"):
        generate("weipipe-interleave", 1, 2)
    with pytest.raises(ScheduleError, match="unknown WeiPipe schedule"):
        generate("weipipe-fancy", 4, 2)
    with pytest.raises(ScheduleError, match="multiple of P"):
        megatron_timeline("interleaved", 4, 6)


COSTS = [(1, 1, 1), (1, 1.5, 0.5), (1, 0.8, 1.3), (1, 3, 0.2), (0.7, 1.9, 0.6), (2, 0.3, 0.4), (1, 0.5, 0.5)]


@pytest.mark.parametrize("F,I,W", COSTS)
def test_zb_makespan_and_bubble_closed_form_at_any_costs(F, I, W):
    """weipipe-zb (W at the end of its I's tick) at measured-like costs: makespan
    GP(F+I+W) + (P-1)max(F,I,W); the bubble is (P-1)max / makespan. The lower bound
    (P-1)F + GP(F+I+W) is met exactly when max(I, W) <= F; interleave is the same form
    with B, and zb with I = B, W = 0 is interleave."""
    from megatron_weipipe.schedules.timing.closed_forms import expected_makespan
    from megatron_weipipe.schedules.timing.tick_simulator import DEFAULT_COSTS, simulate

    for P in range(2, 9):
        for G in range(1, 5):
            costs = {**DEFAULT_COSTS, Kind.FORWARD: F, Kind.BACKWARD_INPUT: I, Kind.BACKWARD_WEIGHT: W,
                     Kind.BACKWARD: I + W}
            zb = simulate(generate("weipipe-zb", P, G), costs)
            want = expected_makespan("weipipe-zb", P, G, F, I=I, W=W)
            assert zb.makespan == pytest.approx(want), (P, G)
            m = max(F, I, W)
            assert zb.bubble_fraction == pytest.approx((P - 1) * m / (G * P * (F + I + W) + (P - 1) * m))
            lower = (P - 1) * F + G * P * (F + I + W)
            assert (zb.makespan == pytest.approx(lower)) == (max(I, W) <= F)
            il = simulate(generate("weipipe-interleave", P, G), costs)
            assert il.makespan == pytest.approx(expected_makespan("weipipe-interleave", P, G, F, B=I + W))
            assert zb.makespan <= il.makespan + 1e-9
            stored = simulate(generate("weipipe-zb", P, G), {**costs, Kind.BACKWARD_INPUT: I + W,
                                                              Kind.BACKWARD_WEIGHT: 0.0})
            assert stored.makespan == pytest.approx(il.makespan)
