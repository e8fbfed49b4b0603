"""FPDT: chunked Ulysses attention, offload manager, chunked MLP and chunked loss.

Self-contained building blocks that take explicit process groups; see docs/fpdt.md.
"""

from megatron_weipipe.fpdt.attention import FPDTAttentionFunction, fpdt_attention, ulysses_attention
from megatron_weipipe.fpdt.config import AttentionSpec, FPDTConfig, RotaryConfig, attention_spec_from_megatron, check_layout
from megatron_weipipe.fpdt.kernels import MathKernel, merge, select_kernel
from megatron_weipipe.fpdt.layout import (
    gather_sequence,
    global_order,
    local_token_indices,
    shard,
    shard_batch,
    unshard,
)
from megatron_weipipe.fpdt.loss import chunked_cross_entropy, reference_cross_entropy
from megatron_weipipe.fpdt.mlp import ACTIVATIONS, chunked_mlp, reference_mlp
from megatron_weipipe.fpdt.offload import ChunkStore, HostBufferPool, OffloadStats
from megatron_weipipe.fpdt.ulysses import (
    CommCounter,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    heads_to_seq,
    seq_to_heads,
)

__all__ = [
    "ACTIVATIONS",
    "AttentionSpec",
    "ChunkStore",
    "CommCounter",
    "FPDTAttentionFunction",
    "FPDTConfig",
    "HostBufferPool",
    "MathKernel",
    "OffloadStats",
    "RotaryConfig",
    "all_to_all_heads_to_seq",
    "attention_spec_from_megatron",
    "all_to_all_seq_to_heads",
    "check_layout",
    "chunked_cross_entropy",
    "chunked_mlp",
    "fpdt_attention",
    "gather_sequence",
    "global_order",
    "heads_to_seq",
    "local_token_indices",
    "merge",
    "reference_cross_entropy",
    "reference_mlp",
    "select_kernel",
    "seq_to_heads",
    "shard",
    "shard_batch",
    "ulysses_attention",
    "unshard",
]
