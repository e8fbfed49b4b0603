"""The validator rejects broken schedules with a message naming the rule: each test
mutates a good schedule the way a routing bug would."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_weipipe.schedules.ir.actions import Flow, Kind, ScheduleError
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.check.validate import validate
from megatron_weipipe.schedules.check.execution import walk


def mutate(schedule, rank, fn):
    """Apply fn(list_of_actions) -> list_of_actions to one rank's list."""
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = fn(ranks[rank])
    return schedule.replace_ranks(ranks)


def replace_first(actions, pred, **changes):
    for i, a in enumerate(actions):
        if pred(a):
            actions[i] = dataclasses.replace(a, **changes)
            return actions
    raise AssertionError("no action matched")


def remove_first(actions, pred):
    for i, a in enumerate(actions):
        if pred(a):
            del actions[i]
            return actions
    raise AssertionError("no action matched")


@pytest.mark.parametrize("name", ["weipipe-naive", "weipipe-interleave", "weipipe-zb"])
def test_forward_with_swapped_chunk_index(name):
    s = generate(name, 4, 2)
    bad = mutate(s, 1, lambda acts: replace_first(acts, lambda a: a.kind is Kind.FORWARD and a.chunk == 2, chunk=3))
    with pytest.raises(ScheduleError, match=r"computes with chunk 3 but buffer fwd_weights\[\d\] on rank 1 holds weights of chunk 2"):
        validate(bad)


def test_backward_reading_the_other_slot():
    s = generate("weipipe-interleave", 4, 2)

    def flip(acts):
        a = next(a for a in acts if a.kind is Kind.BACKWARD and a.chunk == 1)
        return replace_first(acts, lambda b: b is a, buffer=dataclasses.replace(a.buffer, slot=1 - a.buffer.slot))

    with pytest.raises(ScheduleError, match=r"\(backward rank=2 tick=8 .*computes with chunk 1 but buffer bwd_weights\[1\] on rank 2 holds nothing"):
        validate(mutate(s, 2, flip))


def test_dropped_recv():
    s = generate("weipipe-zb", 3, 2)
    bad = mutate(s, 2, lambda acts: remove_first(
        acts, lambda a: a.kind is Kind.RECV and a.flow is Flow.BWD_WEIGHTS and a.tick == 6))
    with pytest.raises(ScheduleError, match="holds nothing|empty buffer"):
        validate(bad)


def test_dropped_send_deadlocks():
    s = generate("weipipe-interleave", 3, 1)
    # the gradient of chunk 2 finishes on rank 2 (its owner); chunk 0's goes one more hop to rank 0
    bad = mutate(s, 2, lambda acts: remove_first(
        acts, lambda a: a.kind is Kind.SEND and a.flow is Flow.GRADS and a.chunk == 0 and a.peer == 0))
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 0 waits at \(recv rank=0 .*flow=grads"):
        validate(bad)


def _reverse(schedule, flow):
    P = schedule.num_ranks
    ranks = []
    for acts in schedule.ranks:
        out = []
        for a in acts:
            if a.kind is Kind.SEND and a.flow is flow:
                a = dataclasses.replace(a, peer=(a.rank - 1) % P)
            elif a.kind is Kind.RECV and a.flow is flow:
                a = dataclasses.replace(a, peer=(a.rank + 1) % P)
            out.append(a)
        ranks.append(out)
    return schedule.replace_ranks(ranks)


@pytest.mark.parametrize("P", [3, 4, 5])
def test_backward_weights_routed_the_wrong_way(P):
    """The public reference code's bug class: backward weights sent r -> r-1. Sends and
    receives still pair up; the symbolic contents show the wrong chunk arriving."""
    bad = _reverse(generate("weipipe-interleave", P, 2), Flow.BWD_WEIGHTS)
    with pytest.raises(ScheduleError, match="must move r -> r\\+1"):
        validate(bad)
    with pytest.raises(ScheduleError, match="expects chunk .* but the message carries weights of chunk"):
        validate(bad, check_direction=False)


def test_wrong_direction_is_invisible_at_ring_size_two():
    # previous and next are one rank, so the reversed routing is the same schedule
    s = generate("weipipe-interleave", 2, 2)
    assert _reverse(s, Flow.BWD_WEIGHTS) == s
    validate(_reverse(s, Flow.BWD_WEIGHTS), check_direction=False)


def test_flows_sharing_a_tag_at_ring_size_two():
    s = generate("weipipe-zb", 2, 2)
    ranks = [[dataclasses.replace(a, tag=0) if a.kind in (Kind.SEND, Kind.RECV) else a for a in acts]
             for acts in s.ranks]
    with pytest.raises(ScheduleError, match="needs its own tag"):
        validate(s.replace_ranks(ranks))


def test_gradient_never_accumulated_at_owner():
    s = generate("weipipe-interleave", 4, 2)
    bad = mutate(s, 1, lambda acts: remove_first(acts, lambda a: a.kind is Kind.ACCUMULATE_GRAD))
    with pytest.raises(ScheduleError, match=r"chunk 1's gradient is incomplete at its owner: missing \(rank, mb\) \[\(0, 0\)"):
        validate(bad)


def test_contribution_counted_twice():
    s = generate("weipipe-naive", 3, 2)

    def dup(acts):
        i = next(i for i, a in enumerate(acts) if a.kind is Kind.BACKWARD and a.chunk == 2)
        acts.insert(i + 1, acts[i])
        return acts

    with pytest.raises(ScheduleError, match="runs twice"):
        validate(mutate(s, 0, dup))


def test_weight_buffer_overwritten_while_live():
    s = generate("weipipe-interleave", 4, 2)
    bad = mutate(s, 3, lambda acts: remove_first(
        acts, lambda a: a.kind is Kind.DROP and a.buffer.flow is Flow.FWD_WEIGHTS and a.chunk == 0))
    with pytest.raises(ScheduleError, match=r"overwrites buffer fwd_weights\[\d\] on rank 3, which still holds weights of chunk 0"):
        validate(bad)


def test_backward_before_forward():
    s = generate("weipipe-naive", 2, 2)
    bad = mutate(s, 0, lambda acts: replace_first(
        acts, lambda a: a.kind is Kind.BACKWARD and a.mb == 0 and a.chunk == 1, mb=1))
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate(bad)


def test_load_by_a_rank_that_does_not_own_the_chunk():
    s = generate("weipipe-interleave", 4, 1)
    bad = mutate(s, 3, lambda acts: replace_first(acts, lambda a: a.kind is Kind.LOAD, chunk=2))
    with pytest.raises(ScheduleError, match="loads chunk 2, which it does not own"):
        validate(bad)


def test_wrong_way_routing_does_not_even_pair_up():
    # ranks send different numbers of backward-weight messages, so reversed, they starve
    bad = _reverse(generate("weipipe-interleave", 3, 2), Flow.BWD_WEIGHTS)
    with pytest.raises(ScheduleError, match="deadlock"):
        walk(bad, lambda a, m: None)
