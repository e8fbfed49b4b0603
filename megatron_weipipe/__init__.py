"""Megatron-style pretraining for long contexts: WeiPipe and FPDT on megatron-core."""

__version__ = "0.1.0"
