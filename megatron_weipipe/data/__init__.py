"""Data layer: offline tokenizers, Megatron indexed datasets via megatron-core, mock data."""

from megatron_weipipe.data.datasets import (
    DataConfig,
    IndexedDatasetInfo,
    build_data_loader,
    build_gpt_dataset_config,
    build_train_valid_test_datasets,
    check_indexed_dataset,
    parse_blend,
)
from megatron_weipipe.data.samplers import PretrainingSampler
from megatron_weipipe.data.tokenizers import (
    TOKENIZER_TYPES,
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "DataConfig",
    "IndexedDatasetInfo",
    "build_data_loader",
    "build_gpt_dataset_config",
    "build_train_valid_test_datasets",
    "check_indexed_dataset",
    "parse_blend",
    "PretrainingSampler",
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_tokenizer",
]
