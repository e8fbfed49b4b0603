import itertools

import pytest

from megatron_weipipe.data.samplers import PretrainingSampler


def _global_stream(total, consumed, mbs, dp, drop_last=True):
    """Interleave the ranks' micro-batches step by step, as one global sample stream."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]
    steps = max(len(b) for b in per_rank)
    out = []
    for s in range(steps):
        for r in range(dp):
            if s < len(per_rank[r]):
                out.extend(per_rank[r][s])
    return per_rank, out


@pytest.mark.parametrize("mbs, dp", [(1, 1), (4, 1), (2, 3), (3, 4)])
def test_ranks_are_disjoint_and_cover_in_order(mbs, dp):
    total = 101
    per_rank, stream = _global_stream(total, 0, mbs, dp)
    full = (total // (mbs * dp)) * mbs * dp
    assert stream == list(range(full))
    flat = [set(itertools.chain.from_iterable(b)) for b in per_rank]
    for a, b in itertools.combinations(flat, 2):
        assert not a & b
    for batches in per_rank:
        assert all(len(b) == mbs for b in batches)
        assert len(batches) == len(PretrainingSampler(total, 0, mbs, 0, dp))


@pytest.mark.parametrize("k", [0, 1, 5, 12, 13, 60])
def test_resuming_at_k_equals_skipping_k(k):
    mbs, dp, total = 2, 3, 97
    _, resumed = _global_stream(total, k, mbs, dp)
    assert resumed == list(range(k, k + len(resumed)))
    assert len(resumed) == ((total - k) // (mbs * dp)) * mbs * dp
    if k % (mbs * dp) == 0:
        # At a global-batch boundary, every rank continues exactly where it would have been.
        for r in range(dp):
            uninterrupted = list(PretrainingSampler(total, 0, mbs, r, dp))
            assert list(PretrainingSampler(total, k, mbs, r, dp)) == uninterrupted[k // (mbs * dp):]


def test_keep_last_partial_batch_splits_remainder():
    mbs, dp, total = 4, 2, 21  # two full global batches, then 5 samples left
    per_rank, stream = _global_stream(total, 0, mbs, dp, drop_last=False)
    assert stream == list(range(total))
    assert per_rank[0][-1] == [16, 17, 18, 19] and per_rank[1][-1] == [20]
    assert len(PretrainingSampler(total, 0, mbs, 1, dp, drop_last=False)) == 3
    assert len(list(PretrainingSampler(17, 0, mbs, 1, dp, drop_last=False))) == 2


def test_is_deterministic():
    a = list(PretrainingSampler(50, 6, 3, 1, 2))
    b = list(PretrainingSampler(50, 6, 3, 1, 2))
    assert a == b and a[0] == [9, 10, 11]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(total_samples=0), "no samples"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(data_parallel_rank=2), "data_parallel_rank"),
        (dict(consumed_samples=11), "consumed_samples"),
        (dict(data_parallel_size=0), "data_parallel_size"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = dict(total_samples=10, consumed_samples=0, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(**args)
