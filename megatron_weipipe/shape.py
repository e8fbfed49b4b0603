"""Shape arithmetic of a GPT model: FFN width, padded vocabulary, parameter counts, FLOPs.

The one home of these rules: the model builder, the training log's TFLOP/s and the
simulator all read them from here. Parameter counts follow megatron-core's local GPT
layer spec exactly (they are what WeiPipe's flat chunk buffers and Megatron's gradient
buffers hold, so byte predictions can be exact). FLOPs are counted per microbatch for
the whole layer; callers divide by tensor / context parallel sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require


def ffn_hidden_size(hidden_size: int, swiglu: bool, ffn_hidden_size: Optional[int] = None) -> int:
    """Megatron-LM's FFN width: 4h, or for SwiGLU without --ffn-hidden-size int(4h * 2/3 / 64) * 64,
    which keeps a gated MLP's parameter count near a 4h GeLU MLP's (320 at h=128)."""
    if ffn_hidden_size is not None:
        return ffn_hidden_size
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Megatron's padding: a multiple of divisible_by x TP so the embedding splits evenly."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int = 1
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 32000  # the tokenizer's; padded like Megatron (see padded_vocab)
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: Optional[int] = None
    untie_embeddings_and_output_weights: bool = False

    def validate(self) -> "ModelShape":
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                     "vocab_size"):
            require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive")
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}) unless --kv-channels is given")
        require(self.num_attention_heads % self.groups == 0,
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.groups})")
        require(self.normalization in ("LayerNorm", "RMSNorm"),
                f"--normalization must be LayerNorm or RMSNorm, not {self.normalization!r}")
        require(self.position_embedding_type in ("learned_absolute", "rope", "none"),
                f"--position-embedding-type must be learned_absolute, rope or none, not "
                f"{self.position_embedding_type!r}")
        require(self.ffn > 0, f"--swiglu at --hidden-size {self.hidden_size} gives Megatron's default FFN width "
                              f"int(4h * 2/3 / 64) * 64 = 0; give --ffn-hidden-size")
        return self

    # ------------------------------------------------------------------ sizes
    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        """The FFN width the model is built with (Megatron-LM's default when not given)."""
        return ffn_hidden_size(self.hidden_size, self.swiglu, self.ffn_hidden_size)

    @property
    def qkv_width(self) -> int:
        return (self.num_attention_heads + 2 * self.groups) * self.head_dim

    @property
    def attn_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    def padded_vocab(self, tp: int = 1) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch."""
        return self.micro_batch_size * self.seq_length

    # ------------------------------------------------------------------ parameters
    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def layer_params(self, tp: int = 1) -> int:
        """One TransformerLayer of the local spec (norms, qkv, proj, fc1, fc2, biases) on one
        tensor-parallel rank: column-parallel weights and biases split, row-parallel biases
        and norms replicated."""
        h, f = self.hidden_size, self.ffn
        fc1_out = f * (2 if self.swiglu else 1)
        bias = self.add_bias_linear
        qkv = (self.qkv_width * h + (self.qkv_width if (bias or self.add_qkv_bias) else 0)) // tp
        proj = h * self.attn_width // tp + (h if bias else 0)
        fc1 = (fc1_out * h + (fc1_out if bias else 0)) // tp
        fc2 = h * f // tp + (h if bias else 0)
        return 2 * self.norm_params() + qkv + proj + fc1 + fc2

    def word_embedding_params(self, tp: int = 1) -> int:
        """This TP rank's shard of the (padded) word embedding."""
        return self.padded_vocab(tp) * self.hidden_size // tp

    def position_embedding_params(self) -> int:
        if self.position_embedding_type != "learned_absolute":
            return 0
        return (self.max_position_embeddings or self.seq_length) * self.hidden_size

    def embedding_params(self, tp: int = 1) -> int:
        """The first stage's embedding (word + learned positions)."""
        return self.word_embedding_params(tp) + self.position_embedding_params()

    def head_params(self, tp: int = 1) -> int:
        """The last stage's final norm and output layer (a copy of the word embedding when tied)."""
        return self.norm_params() + self.word_embedding_params(tp)

    def total_params(self) -> int:
        out = self.num_layers * self.layer_params() + self.embedding_params() + self.norm_params()
        if self.untie_embeddings_and_output_weights:
            out += self.word_embedding_params()
        return out

    # ------------------------------------------------------------------ FLOPs (one microbatch, whole layer)
    def layer_gemm_flops(self) -> float:
        """Forward FLOPs of the layer's matmuls (qkv, proj, fc1, fc2)."""
        T, h, f = self.tokens, self.hidden_size, self.ffn
        fc1_out = f * (2 if self.swiglu else 1)
        return 2.0 * T * h * (self.qkv_width + self.attn_width + fc1_out + f)

    def attention_flops(self, causal_fraction: float = 0.5) -> float:
        """Forward FLOPs of scores and weighted sum; causal_fraction 0.5 when masked blocks are skipped."""
        b, s = self.micro_batch_size, self.seq_length
        return 4.0 * b * s * s * self.attn_width * causal_fraction

    def head_flops(self) -> float:
        """Forward FLOPs of the output layer (logits)."""
        return 2.0 * self.tokens * self.hidden_size * self.padded_vocab()

    def model_flops_per_microbatch(self, causal_fraction: float = 0.5) -> float:
        """Training FLOPs of one microbatch: 3 x forward (model FLOPs: a recomputed forward,
        full or selective, is not counted, as in Megatron-LM's logged TFLOP/s).

        causal_fraction 0.5 counts the attention a causal kernel really computes; 1.0 counts
        the full square, which is Megatron-LM's convention for the logged TFLOP/s.
        """
        fwd = (self.num_layers * (self.layer_gemm_flops() + self.attention_flops(causal_fraction))
               + self.head_flops())
        return 3.0 * fwd
