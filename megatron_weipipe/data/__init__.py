"""Data layer: offline tokenizers, Megatron indexed datasets via megatron-core, mock data.

Names are loaded on first use, so that reading the data flags (``data.config``) imports
neither torch nor megatron-core.
"""

from megatron_weipipe.lazy import lazy_exports

_EXPORTS = {
    "DataConfig": "config",
    "IndexedDatasetInfo": "config",
    "check_indexed_dataset": "config",
    "parse_blend": "config",
    "build_data_loader": "datasets",
    "build_gpt_dataset_config": "datasets",
    "build_train_valid_test_datasets": "datasets",
    "PretrainingSampler": "samplers",
    "TOKENIZER_TYPES": "config",
    "ByteLevelTokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers",
    "NullTokenizer": "tokenizers",
    "SentencePieceTokenizer": "tokenizers",
    "TikTokenizer": "bpe_tokenizers",
    "GPT2BPETokenizer": "bpe_tokenizers",
    "TokenizerConfig": "config",
    "Tokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
