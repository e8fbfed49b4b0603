"""FPDT: chunked Ulysses attention, offload manager, chunked MLP and chunked loss.

Self-contained building blocks that take explicit process groups; see docs/how-it-works/fpdt.md.
Names load on first use, so that the FPDT flags (``fpdt.config``) import no torch.
"""

from megatron_weipipe.lazy import lazy_exports

_EXPORTS = {
    "FPDTAttentionFunction": "chunked_attention",
    "fpdt_attention": "chunked_attention",
    "ulysses_attention": "chunked_attention",
    "AttentionSpec": "config",
    "FPDTConfig": "config",
    "RotaryConfig": "config",
    "attention_spec_from_megatron": "config",
    "check_layout": "config",
    "cp_heads_fit": "config",
    "kv_heads_per_rank": "config",
    "ulysses_heads_sent": "config",
    "MathKernel": "kernels",
    "merge": "kernels",
    "select_kernel": "kernels",
    "gather_sequence": "token_layout",
    "global_order": "token_layout",
    "local_token_indices": "token_layout",
    "shard": "token_layout",
    "shard_batch": "token_layout",
    "unshard": "token_layout",
    "chunked_cross_entropy": "loss",
    "reference_cross_entropy": "loss",
    "ACTIVATIONS": "mlp",
    "chunked_mlp": "mlp",
    "reference_mlp": "mlp",
    "ChunkStore": "offload",
    "HostBufferPool": "offload",
    "OffloadStats": "offload",
    "CommCounter": "ulysses",
    "all_to_all_heads_to_seq": "ulysses",
    "all_to_all_seq_to_heads": "ulysses",
    "heads_to_seq": "ulysses",
    "seq_to_heads": "ulysses",
    "spread_kv": "ulysses",
    "gather_kv": "ulysses",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
