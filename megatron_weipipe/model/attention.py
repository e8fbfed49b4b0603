"""Core attention through torch's scaled_dot_product_attention, for hosts without Transformer Engine.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] scores and
probabilities, which do not fit at 32K tokens. ``SDPACoreAttention`` is the same module
(same constructor, softmax scale, RNG-tracker fork around dropout, output layout) with
its forward through ``torch.nn.functional.scaled_dot_product_attention``: on a CPU host
the fused flash kernel (memory linear in s) when there is no dropout. Grouped K/V heads
are repeated as megatron-core repeats them; a boolean ``attention_mask`` (True = masked,
megatron's convention, e.g. from --reset-attention-mask) is passed inverted as SDPA's
mask. With attention dropout in training SDPA falls back to its math kernel, which
draws the dropout mask with the same ``at::dropout`` call on the same [b, heads, sq, sk]
probabilities as megatron-core's ``nn.Dropout``: the same mask from the same RNG state.
What this forward does not implement falls back to megatron-core's own forward (one rule,
``_megatron_only``). tests/test_attention_sdpa.py checks outputs and every gradient
against megatron-core's forward at equal weights and seed.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

# The values of Megatron-LM's --attention-backend, and which core attention each selects
# on a host without Transformer Engine: torch's fused SDPA kernel, or megatron-core's
# unfused local DotProductAttention.
BACKENDS = ("flash", "fused", "unfused", "local", "auto")
SDPA_BACKENDS = ("flash", "fused")


class SDPACoreAttention(DotProductAttention):
    """megatron-core's DotProductAttention with its forward through torch SDPA."""

    def _megatron_only(self, attention_bias, packed_seq_params) -> bool:
        """Features megatron-core's forward handles (or refuses) itself: layer-scaled
        softmax, sliding windows, softmax offsets, attention bias, packed sequences."""
        c = self.config
        return (attention_bias is not None or packed_seq_params is not None or c.apply_query_key_layer_scaling
                or self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self._megatron_only(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:  # [s, b, groups, d] -> [s, b, heads, d], as megatron-core repeats them
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if attention_mask is None:
            mask, causal = None, q.size(2) > 1
        else:
            mask, causal = ~attention_mask.to(torch.bool), False
        p = self.attention_dropout.p if self.training else 0.0
        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, mask, causal, p)
        else:
            out = self._sdpa(q, k, v, mask, causal, p)
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, mask, causal, p):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.softmax_scale)


def core_attention_class(backend: str):
    """The core-attention module a resolved backend name selects (local spec only)."""
    return SDPACoreAttention if backend in SDPA_BACKENDS else DotProductAttention
