"""GPT pretraining datasets from Megatron .bin/.idx files (or mock data) via megatron-core.

megatron-core does the real work (``BlendedMegatronDatasetBuilder``, ``GPTDataset``,
``BlendedDataset``, ``MockGPTDataset``); this module adds what it leaves to the caller:
a typed config validated up front with one-sentence errors (missing or truncated files
would otherwise crash deep in numpy, and an empty split would loop forever), blend parsing,
and a resumable data loader.
"""

from __future__ import annotations

import copy
import os
import re
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType

from megatron_weipipe.data.samplers import PretrainingSampler
from megatron_weipipe.data.tokenizers import Tokenizer, check_tokenizer_args

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence and document counts (8 + 8)
_SPLIT_RE = re.compile(r"^\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*$")
_SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class IndexedDatasetInfo:
    """What a consistent .idx promises about its .bin."""

    prefix: str
    dtype: type
    num_sequences: int
    num_documents: int
    bin_bytes: int


def _describe(path: str) -> str:
    return f"{path} ({os.path.getsize(path)} bytes)"


def check_indexed_dataset(prefix: str) -> IndexedDatasetInfo:
    """Check that ``prefix``.idx parses and ``prefix``.bin holds every byte it promises.

    Reads only the header and a few entries, so it is cheap for any dataset size: in a
    well-formed index the last sequence's pointer plus its length times the dtype size is
    the sum of all sequence lengths times the dtype size. Raises ValueError naming the file.
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"data file {path} does not exist (data prefix {prefix}).")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
        if len(head) < _IDX_HEADER_BYTES:
            raise ValueError(f"index file {_describe(idx_path)} is truncated inside its header.")
        magic, version, code, num_seq, num_doc = struct.unpack("<9sQBQQ", head)
        if magic != _IDX_MAGIC:
            raise ValueError(f"index file {idx_path} is not a Megatron indexed dataset (bad magic bytes).")
        if version != 1:
            raise ValueError(f"index file {idx_path} has unsupported version {version}.")
        try:
            dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"index file {idx_path} has unknown token dtype code {code}.") from None
        need = _IDX_HEADER_BYTES + num_seq * (4 + 8) + num_doc * 8
        if idx_size < need:
            raise ValueError(
                f"index file {_describe(idx_path)} is truncated: its header promises {num_seq} "
                f"sequences and {num_doc} documents, which need {need} bytes."
            )
        if num_seq == 0 or num_doc < 2:
            raise ValueError(f"index file {idx_path} holds no documents.")
        lengths_at = _IDX_HEADER_BYTES
        pointers_at = lengths_at + 4 * num_seq
        docs_at = pointers_at + 8 * num_seq
        f.seek(lengths_at + 4 * (num_seq - 1))
        (last_len,) = struct.unpack("<i", f.read(4))
        f.seek(pointers_at)
        (first_ptr,) = struct.unpack("<q", f.read(8))
        f.seek(pointers_at + 8 * (num_seq - 1))
        (last_ptr,) = struct.unpack("<q", f.read(8))
        f.seek(docs_at)
        (first_doc,) = struct.unpack("<q", f.read(8))
        f.seek(docs_at + 8 * (num_doc - 1))
        (last_doc,) = struct.unpack("<q", f.read(8))
    if first_ptr != 0 or last_ptr < 0 or last_len < 0 or first_doc != 0 or last_doc != num_seq:
        raise ValueError(f"index file {idx_path} is corrupt (inconsistent pointers or document ends).")
    itemsize = numpy.dtype(dtype).itemsize
    bin_need = last_ptr + last_len * itemsize
    bin_size = os.path.getsize(bin_path)
    if bin_size < bin_need:
        raise ValueError(
            f"data file {bin_path} ({bin_size} bytes) is truncated: its index {idx_path} promises "
            f"{bin_need} bytes of {numpy.dtype(dtype).name} tokens."
        )
    return IndexedDatasetInfo(prefix, dtype, num_seq, num_doc - 1, bin_need)


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron blend syntax: ``[prefix, ...]`` or ``[w1, prefix1, w2, prefix2, ...]``."""
    items = [str(p).strip() for p in data_path]
    if not items:
        raise ValueError("data_path is empty; give at least one data prefix.")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(is_number(p) for p in prefixes):
            raise ValueError(f"data_path {data_path} must alternate weight and prefix.")
        if any(not w > 0 for w in weights):
            raise ValueError(f"data_path weights must be positive, got {weights}.")
        return prefixes, weights
    if any(is_number(p) for p in items):
        raise ValueError(
            f"data_path {data_path} mixes weights and prefixes; use [prefix, ...] or [w1, prefix1, w2, prefix2, ...]."
        )
    return items, None


@dataclass(kw_only=True)
class DataConfig:
    """Where training text comes from and how samples are cut from it."""

    data_path: list[str] | None = None
    """Megatron blend: [prefix] or [w1, prefix1, w2, prefix2, ...]; prefixes name .bin/.idx pairs."""
    split: str = "969,30,1"
    """Train/valid/test weights over each prefix's documents, in order."""
    mock_data: bool = False
    """Synthetic tokens from megatron-core's MockGPTDataset instead of data_path."""
    seq_length: int
    seed: int = 1234
    """Seeds the document and sample shuffles."""
    data_cache_path: str | None = None
    """Where shuffle indices are cached; None puts them next to each prefix, as Megatron does."""
    num_workers: int = 0
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    """Materialise the [1, s, s] causal mask per sample; turn off for long sequences."""
    tokenizer_type: str = "ByteLevelTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int | None = None

    def validate(self) -> None:
        """Raise ValueError with one sentence for the first bad value or bad data file."""
        if not isinstance(self.seq_length, int) or self.seq_length < 1:
            raise ValueError(f"seq_length must be a positive integer, got {self.seq_length!r}.")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {self.num_workers!r}.")
        if not isinstance(self.split, str) or not _SPLIT_RE.match(self.split):
            raise ValueError(f"split {self.split!r} must be up to three numbers like '969,30,1'.")
        if sum(float(x) for x in re.split(r"[,/]", self.split)) <= 0:
            raise ValueError(f"split {self.split!r} must have a positive total.")
        check_tokenizer_args(self.tokenizer_type, self.tokenizer_model, self.vocab_size)
        if self.data_cache_path is not None and os.path.exists(self.data_cache_path):
            if not os.path.isdir(self.data_cache_path):
                raise ValueError(f"data_cache_path {self.data_cache_path} exists and is not a directory.")
        if self.mock_data:
            if self.data_path:
                raise ValueError("set either data_path or mock_data, not both.")
            return
        if not self.data_path:
            raise ValueError("no training data: set data_path to a .bin/.idx prefix, or mock_data.")
        if isinstance(self.data_path, str) or not isinstance(self.data_path, (list, tuple)):
            raise ValueError(f"data_path must be a list of strings, got {self.data_path!r}.")
        prefixes, _ = parse_blend(self.data_path)
        for prefix in prefixes:
            info = check_indexed_dataset(prefix)
            self._check_split_has_documents(info)

    def _check_split_has_documents(self, info: IndexedDatasetInfo) -> None:
        # megatron-core loops forever building a split that has no tokens: refuse it here.
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        for name, bounds in zip(_SPLIT_NAMES, matrix):
            if bounds is None:
                continue
            beg = int(round(bounds[0] * info.num_sequences))
            end = int(round(bounds[1] * info.num_sequences))
            if end <= beg:
                raise ValueError(
                    f"split {self.split!r} leaves the {name} split no documents of {info.prefix} "
                    f"({info.num_sequences} documents); give that split weight 0 or use more data."
                )


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
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
