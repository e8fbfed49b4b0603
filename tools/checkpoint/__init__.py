"""Checkpoint conversion between Hugging Face Llama and megatron-core: the key and shape
mapping (hf_llama) and the command that reads and writes both formats (convert)."""
