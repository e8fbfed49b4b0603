"""The data flags and their rules: where training text comes from and how samples are cut.

The checks read only file headers, so a missing or truncated .bin/.idx, a bad blend or an
empty split fails at start-up with one sentence instead of deep in numpy, or in a loop
that never ends.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy

from megatron_weipipe.flags import option

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence and document counts (8 + 8)
# Quotes around the numbers are what a shell leaves of "--split '99,1,0'" in an unquoted array
# expansion (Megatron-LM's Llama-3 scripts); megatron-core reads only the numbers.
_SPLIT_RE = re.compile(r"""^\s*['"]?\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*['"]?\s*$""")
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
    from megatron.core.datasets.indexed_dataset import DType

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


TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
    "TikTokenizer",
    "GPT2BPETokenizer",
)
# megatron-core's TikTokenTokenizer: the special tokens a list must hold, and the vocabulary size it assumes.
TIKTOKEN_REQUIRED_SPECIAL = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17
_NEEDS_MODEL_FILE = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer")


@dataclass(kw_only=True)
class TokenizerConfig:
    """Megatron-LM's tokenizer flags, shared by pretrain_gpt.py and tools/preprocess_data.py
    (Megatron-LM's preprocessing takes the same ones). Only local files are read."""

    tokenizer_type: str = option("ByteLevelTokenizer", help=f"{', '.join(TOKENIZER_TYPES[:-1])} or "
                                                             f"{TOKENIZER_TYPES[-1]}")
    tokenizer_model: str | None = option(None, help="local tokenizer.json, SentencePiece model, or TikTokenizer "
                                                    "vocabulary (.json of ranks and base64 token bytes)")
    vocab_size: int | None = option(None, help="NullTokenizer: ids before the EOD; TikTokenizer: special tokens plus "
                                               f"the file's first tokens kept (default {TIKTOKEN_DEFAULT_VOCAB_SIZE})")
    vocab_file: str | None = option(None, help="GPT2BPETokenizer's vocab.json")
    merge_file: str | None = option(None, help="GPT2BPETokenizer's merges.txt")
    tiktoken_pattern: str | None = option(None, choices=("v1", "v2"), help="TikTokenizer's pre-split regex "
                                          "(megatron-core's v1 or v2; default v2); other tokenizers ignore it")
    tiktoken_num_special_tokens: int = option(1000, help="TikTokenizer: ids 0..N-1 are special tokens, the file's "
                                                         "ranks start at N")
    tokenizer_special_tokens: list[str] | None = option(
        None, help="TikTokenizer's special tokens in id order, holding " + " ".join(TIKTOKEN_REQUIRED_SPECIAL)
                   + "; <SPECIAL_i> fill the rest up to --tiktoken-num-special-tokens")
    tiktoken_special_tokens: list[str] | None = option(None, help="Megatron-LM's former (deprecated) spelling of "
                                                                  "--tokenizer-special-tokens")

    @property
    def special_tokens(self) -> list[str] | None:
        return self.tokenizer_special_tokens or self.tiktoken_special_tokens

    def check_tokenizer(self) -> None:
        """Raise ValueError with one sentence if these flags cannot build a tokenizer."""
        kind = self.tokenizer_type
        if kind not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}.")
        if kind in _NEEDS_MODEL_FILE:
            if not self.tokenizer_model:
                raise ValueError(f"{kind} needs tokenizer_model, the path of a local file.")
            if not os.path.isfile(self.tokenizer_model):
                raise ValueError(f"tokenizer_model file {self.tokenizer_model} does not exist.")
        if kind == "NullTokenizer" and (self.vocab_size is None or int(self.vocab_size) < 1):
            raise ValueError("NullTokenizer needs vocab_size, a positive integer.")
        if kind == "GPT2BPETokenizer":
            for flag, path in (("--vocab-file", self.vocab_file), ("--merge-file", self.merge_file)):
                if not path or not os.path.isfile(path):
                    raise ValueError(f"GPT2BPETokenizer needs {flag}, a local file "
                                     f"({'not given' if not path else path + ' does not exist'}).")
        if kind == "TikTokenizer":
            self._check_tiktoken()

    def _check_tiktoken(self) -> None:
        """megatron-core's TikTokenTokenizer asserts these; say which flag breaks them."""
        if not self.tokenizer_model.endswith(".json"):
            raise ValueError(f"TikTokenizer reads a .json vocabulary, not {self.tokenizer_model}.")
        special = self.special_tokens or list(TIKTOKEN_REQUIRED_SPECIAL)
        vocab = self.vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE
        missing = [t for t in TIKTOKEN_REQUIRED_SPECIAL if t not in special]
        if missing or len(set(special)) != len(special):
            raise ValueError(f"--tokenizer-special-tokens must hold {' '.join(TIKTOKEN_REQUIRED_SPECIAL)} once each"
                             + (f" (missing {' '.join(missing)})." if missing else " (a token repeats)."))
        if not len(special) <= self.tiktoken_num_special_tokens < vocab:
            raise ValueError(f"--tiktoken-num-special-tokens ({self.tiktoken_num_special_tokens}) must be at least "
                             f"the {len(special)} special tokens and below --vocab-size ({vocab}).")


def check_tokenizer_args(
    tokenizer_type: str | None, tokenizer_model: str | None, vocab_size: int | None, **options
) -> None:
    """Raise ValueError with one sentence if these arguments cannot build a tokenizer."""
    TokenizerConfig(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size,
                    **options).check_tokenizer()


@dataclass(kw_only=True)
class DataConfig(TokenizerConfig):
    """Where training text comes from, how it is tokenized and how samples are cut from it."""

    data_path: list[str] | None = option(
        None, help="Megatron blend: PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ...; prefixes name .bin/.idx pairs")
    split: str = option("969,30,1", help="train/valid/test weights over each prefix's documents, in order")
    mock_data: bool = option(False, help="synthetic tokens (megatron-core's MockGPTDataset) instead of --data-path")
    seq_length: int  # the model's --seq-length
    seed: int = 1234  # the run's --seed: document and sample shuffles
    data_cache_path: str | None = option(
        None, help="where shuffle indices are cached (default: next to each prefix, as Megatron does)")
    num_workers: int = option(0, help="data-loader worker processes")
    reset_position_ids: bool = option(False, help="restart position ids after each end-of-document token")
    reset_attention_mask: bool = option(False, help="documents in a sample do not attend to each other")
    eod_mask_loss: bool = option(False, help="no loss on end-of-document tokens")
    create_attention_mask_in_dataloader: bool = option(
        True, flag="--no-create-attention-mask-in-dataloader", inverted=True,
        help="no [s, s] attention mask from the data loader: --reset-attention-mask is then turned off with a "
             "warning, as megatron-core's dataset ignores it without one (the model's causal mask is unchanged)")
    mmap_bin_files: bool = option(True, flag="--no-mmap-bin-files", inverted=True,
                                  help="read the .bin files with file reads instead of memory maps "
                                       "(megatron-core's mmap_bin_files)")
    create_attention_mask: bool = True
    """Materialise the [1, s, s] mask per sample; only needed with --reset-attention-mask (the
    model applies the causal mask itself). Derived (PretrainConfig.with_derived_defaults)."""

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
        if sum(float(x) for x in re.findall(r"[.0-9]+", self.split)) <= 0:
            raise ValueError(f"split {self.split!r} must have a positive total.")
        self.check_tokenizer()
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
        from megatron.core.datasets.blended_megatron_dataset_config import (
            convert_split_vector_to_split_matrix,
            parse_and_normalize_split,
        )

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


