"""Data layer: offline tokenizers, Megatron indexed datasets via megatron-core, mock data.

Names are loaded on first use, so that reading the data flags (``data.config``) imports
neither torch nor megatron-core.
"""

import importlib

_EXPORTS = {
    "DataConfig": "config",
    "IndexedDatasetInfo": "config",
    "check_indexed_dataset": "config",
    "parse_blend": "config",
    "build_data_loader": "datasets",
    "build_gpt_dataset_config": "datasets",
    "build_train_valid_test_datasets": "datasets",
    "PretrainingSampler": "samplers",
    "TOKENIZER_TYPES": "tokenizers",
    "ByteLevelTokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers",
    "NullTokenizer": "tokenizers",
    "SentencePieceTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
