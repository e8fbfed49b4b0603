"""The schedules under NCCL's point-to-point rules (check/nccl.py), on the programs the
runtime posts (ir/posts.py): today's receive-first order deadlocks at a ring of 2, the
runtime's order and the grouped order pass for every schedule, and the walker catches
what NCCL would pair differently from the tags."""

from __future__ import annotations

import pytest

from tools import check_schedules
from megatron_weipipe.schedules.ir.actions import ScheduleError
from megatron_weipipe.schedules.generate.megatron_timeline import build
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.check.validate import validate
from megatron_weipipe.schedules.ir.actions import Action, Flow, Kind, Schedule
from megatron_weipipe.schedules.check.nccl import nccl_walk
from megatron_weipipe.schedules.ir.posts import Post, programs, rank_posts


def test_receive_first_deadlocks_at_a_ring_of_two():
    s = generate("weipipe-naive", 2, 1)
    validate(s, order="recv-first")  # gloo: sends are buffered, fine
    with pytest.raises(ScheduleError, match="deadlock under NCCL semantics: rank 0 waits at .*recv.* on the ring "
                                            "pair communicator of ranks 0 and 1; rank 1 waits at .*recv"):
        validate(s, semantics="nccl", order="recv-first")


def test_receive_first_is_fine_where_each_direction_has_its_own_communicator():
    validate(generate("weipipe-zb", 3, 2), semantics="nccl", order="recv-first")


@pytest.mark.parametrize("order", ["parity", "grouped"])
def test_check_tool_passes_every_schedule(order, capsys):
    assert check_schedules.main(["--semantics", "nccl", "--order", order]) == 0
    out = capsys.readouterr().out
    assert "ok: 179 schedules pass under nccl semantics" in out


def test_check_tool_fails_on_receive_first_naming_the_deadlock(capsys):
    assert check_schedules.main(["--semantics", "nccl", "--order", "recv-first"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL weipipe-naive P=2 G=1 order=recv-first") and "deadlock" in out
    assert check_schedules.main(["--order", "sideways"]) == 2


def test_parity_needs_lookahead_one():
    with pytest.raises(ScheduleError, match="lookahead 1"):
        rank_posts(generate("weipipe-zb", 2, 1), 0, order="parity", lookahead=2)


def test_grouped_posts_one_batch_per_round_before_its_receives():
    s = generate("weipipe-interleave", 4, 2)
    for r, prog in enumerate(programs(s, "grouped")):
        posted = set()
        for step in prog:
            if isinstance(step, Post):
                assert step.batched
                posted.update(step.ops)
            elif s.ranks[r][step].kind is Kind.RECV:
                assert step in posted


def test_nccl_pairs_by_order_not_tag():
    """Two flows from rank 0 to rank 1 posted in crossed order on one pair communicator:
    gloo's tags keep them apart, NCCL would swap them; the walker says so."""
    def msg(kind, rank, flow, peer, chunk):
        return Action(kind, rank, 0, chunk=chunk, peer=peer, flow=flow, tag=flow.tag)

    r0 = (msg(Kind.SEND, 0, Flow.FWD_WEIGHTS, 1, 0), msg(Kind.SEND, 0, Flow.GRADS, 1, 0))
    r1 = (msg(Kind.RECV, 1, Flow.GRADS, 0, 0), msg(Kind.RECV, 1, Flow.FWD_WEIGHTS, 0, 0))
    s = Schedule(name="crossed", family="megatron", num_ranks=2, num_chunks=1, microbatches=1, ranks=(r0, r1))
    progs = [[0, Post((0,), False), 1, Post((1,), False)], [Post((0,), False), Post((1,), False), 0, 1]]
    with pytest.raises(ScheduleError, match="NCCL pairs .*fwd_weights.* with .*grads"):
        nccl_walk(s, progs)


def test_megatron_interleaved_batched_at_two_ranks_mispairs():
    """megatron-core's batched call at a pipeline of 2: send_prev goes first on one side,
    recv_prev first on the other, one peer: NCCL would pair a gradient with an activation."""
    with pytest.raises(ScheduleError, match="NCCL pairs .*activation_grads.* with .*activations"):
        validate(build("interleaved", 2, 2), semantics="nccl", order="batched")
    validate(build("interleaved", 2, 2), semantics="nccl", order="parity")
