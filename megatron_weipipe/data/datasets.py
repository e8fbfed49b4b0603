"""GPT pretraining datasets from Megatron .bin/.idx files (or mock data) via megatron-core.

megatron-core does the real work (``BlendedMegatronDatasetBuilder``, ``GPTDataset``,
``BlendedDataset``, ``MockGPTDataset``); this module adds what it leaves to the caller:
a typed config validated up front with one-sentence errors (missing or truncated files
would otherwise crash deep in numpy, and an empty split would loop forever), blend parsing,
and a resumable data loader.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from megatron_weipipe.data.config import DataConfig, parse_blend
from megatron_weipipe.data.samplers import PretrainingSampler
from megatron_weipipe.data.tokenizers import Tokenizer

class _Builder(BlendedMegatronDatasetBuilder):
    """megatron-core's builder, made safe to blend without a process group.

    With a cache path, ``BlendedDataset`` calls ``torch.distributed.get_rank()`` on a cache
    miss, which raises when no group exists. Single-process runs then build the (cheap)
    blending indices in memory; the per-prefix GPTDataset indices are still cached.
    """

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):  # type: ignore[override]
        if cls is BlendedDataset and not dist.is_initialized():
            config = copy.copy(args[-1])
            config.path_to_cache = None
            args = (*args[:-1], config)
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def build_gpt_dataset_config(cfg: DataConfig, tokenizer: Tokenizer) -> GPTDatasetConfig:
    """Translate our config into megatron-core's (mock when ``cfg.mock_data``)."""
    return GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=None if cfg.mock_data else parse_blend(cfg.data_path or []),
        split=cfg.split,
        path_to_cache=cfg.data_cache_path,
        mmap_bin_files=cfg.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask,
    )


def build_train_valid_test_datasets(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    train_valid_test_num_samples: Sequence[int | None],
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Build (train, valid, test); a split with weight 0 gives None.

    Call on every rank when a process group exists (rank 0 builds the index cache first,
    the others load it after a barrier). ``is_built_on_rank`` may skip ranks that never
    read data; it must return True on global rank 0.
    """
    cfg.validate()
    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ValueError(f"train_valid_test_num_samples needs 3 entries, got {len(sizes)}.")
    if any(s is not None and (not isinstance(s, int) or s < 0) for s in sizes):
        raise ValueError(f"train_valid_test_num_samples must be non-negative integers, got {sizes}.")
    if not cfg.mock_data:
        _, weights = parse_blend(cfg.data_path or [])
        if weights is not None and any(s is None for s in sizes):
            raise ValueError("a weighted data_path blend needs a sample count for every split.")
    if tokenizer.vocab_size <= tokenizer.eod:
        raise ValueError(f"tokenizer eod id {tokenizer.eod} is not below its vocab_size {tokenizer.vocab_size}.")
    config = build_gpt_dataset_config(cfg, tokenizer)
    cls = MockGPTDataset if cfg.mock_data else GPTDataset
    builder = _Builder(cls, sizes, is_built_on_rank or (lambda: True), config)
    train, valid, test = builder.build()
    return train, valid, test


def build_data_loader(
    dataset: torch.utils.data.Dataset | None,
    micro_batch_size: int,
    consumed_samples: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    drop_last: bool = True,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader | None:
    """A loader over this rank's micro-batches, resuming after ``consumed_samples``.

    Batches are dicts of stacked tensors: tokens, labels, loss_mask, position_ids and,
    unless the dataset was built without it, attention_mask. None in, None out.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        drop_last=drop_last,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
