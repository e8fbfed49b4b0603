import pytest
import torch
import torch.distributed as dist

from harness import DistributedRunError, run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def _hang(rank, world_size):
    import time

    time.sleep(60)


def test_allreduce_on_two_ranks():
    assert run_distributed(_allreduce, 2, timeout=60) == [3.0, 3.0]


def test_failure_names_rank():
    with pytest.raises(DistributedRunError, match="(?s)rank 1 .*boom on rank one"):
        run_distributed(_fail_on_one, 2, timeout=60)


def test_timeout_kills_children():
    with pytest.raises(DistributedRunError, match="timed out"):
        run_distributed(_hang, 2, timeout=5)
