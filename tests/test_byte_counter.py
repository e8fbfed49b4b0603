"""The process byte counter: collectives count their payload, and nothing where the group
has one rank (it sends nothing; megatron-core's cross entropy all-reduces over the
tensor-parallel group even at TP = 1)."""

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron_weipipe.byte_counter import process_byte_counter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    counter = process_byte_counter()
    alone = dist.new_group([0])
    t = torch.zeros(1000)
    dist.all_reduce(t, group=alone)
    dist.all_reduce(t, dist.ReduceOp.SUM, alone)  # the group passed by position
    dist.broadcast(t, 0, group=alone)
    assert dict(counter.sent) == {}, dict(counter.sent)
    dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.zeros(2000), t)
    assert dict(counter.sent) == {"collectives": 8000}, dict(counter.sent)
    print("ok")
""")


@pytest.mark.timeout(120)
def test_collectives_of_a_one_rank_group_count_nothing():
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]
