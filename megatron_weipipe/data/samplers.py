"""Megatron-style pretraining batch sampler: sequential, deterministic, resumable.

The dataset (GPTDataset / BlendedDataset) is already shuffled by megatron-core, so samples
are walked in index order. Global batch ``b`` covers the ``micro_batch_size *
data_parallel_size`` consecutive indices starting at ``consumed_samples + b * that``, and
data-parallel rank ``r`` takes the ``r``-th micro-batch-sized slice of it. Resuming with
``consumed_samples = k`` therefore yields exactly what an uninterrupted run yields after
``k`` samples, and the ranks' slices never overlap.
"""

from __future__ import annotations

from typing import Iterator


class PretrainingSampler:
    """Yields one micro-batch of dataset indices per step for one data-parallel rank.

    ``consumed_samples`` counts samples across all data-parallel ranks (as checkpoints
    store it). With ``drop_last=False`` a final partial global batch is split among the
    ranks in the same way, so some ranks may get a short or no last micro-batch.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples}).")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}.")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}.")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})."
            )
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} is outside [0, {total_samples}], the dataset size."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def global_step_samples(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def _rank_slice(self, start: int, stop: int) -> list[int]:
        # This rank's part of the global batch [start, stop).
        lo = min(start + self.data_parallel_rank * self.micro_batch_size, stop)
        hi = min(lo + self.micro_batch_size, stop)
        return list(range(lo, hi))

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_step_samples)
        if not self.drop_last and rest and self._rank_slice(0, rest):
            return full + 1
        return full

    def __iter__(self) -> Iterator[list[int]]:
        step = self.global_step_samples
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield self._rank_slice(start, start + step)
            start += step
        if not self.drop_last and start < self.total_samples:
            last = self._rank_slice(start, self.total_samples)
            if last:
                yield last
