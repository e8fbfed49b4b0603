"""Core attention through torch's scaled_dot_product_attention, for megatron-core's local layers.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] scores and
probabilities, which do not fit at 16K-32K tokens. ``SDPACoreAttention`` is the same module
(same constructor, softmax scale, RNG-tracker fork around dropout, output layout) with
its forward through ``torch.nn.functional.scaled_dot_product_attention``: on a CPU host
the fused flash kernel (memory linear in s) when there is no dropout. Grouped K/V heads
are repeated as megatron-core repeats them; a boolean ``attention_mask`` (True = masked,
megatron's convention, e.g. from --reset-attention-mask) is passed inverted as SDPA's
mask. With attention dropout in training SDPA falls back to its math kernel on the CPU,
which draws the dropout mask with the same ``at::dropout`` call on the same [b, heads, sq, sk]
probabilities as megatron-core's ``nn.Dropout``: the same mask from the same RNG state.
What this forward does not implement falls back to megatron-core's own forward (one rule,
``_megatron_only``). tests/test_attention_sdpa.py checks outputs and every gradient
against megatron-core's forward at equal weights and seed.

On a GPU host the layers get ``CudaSDPACoreAttention``: SDPA may use only its flash,
cuDNN and memory-efficient kernels. Left to itself SDPA would take its math kernel
(the [b, heads, s, s] scores again) wherever the others refuse a call: flash refuses
masks, fp32 and head dims over 256, and the memory-efficient kernel refuses grouped K/V
heads in some torch releases. So grouped K/V heads go to SDPA as they are
(``enable_gqa``, no copies) only where flash takes them (no mask, fp16/bf16, head dim
<= 256) and are repeated first elsewhere (a document mask, fp32: a copy linear in s),
where the memory-efficient kernel takes them. A call no fused kernel accepts falls back
to SDPA's own choice with one logged line per call shape. Dropout on a GPU is drawn by
the fused kernel inside the same RNG-tracker fork (the same distribution; not the
mask megatron-core would draw). ``unfused`` / ``local`` keep megatron-core's module.
"""

from __future__ import annotations

import logging

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

# The --attention-backend values (model_config.py's ATTENTION_BACKENDS) whose core attention on local
# layers is torch's fused SDPA kernels; the others keep megatron-core's unfused DotProductAttention.
SDPA_BACKENDS = ("flash", "fused")
# SDPA's kernels whose memory is linear in s (everything but its math kernel).
FUSED_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
FLASH_MAX_HEAD_DIM = 256
NO_KERNEL = ("No available kernel", "No viable backend")  # SDPA's refusal (CUDA, CPU wording)


def requested_backend(cfg) -> str:
    """--attention-backend, with Megatron-LM's --use-flash-attn: ``auto`` becomes ``flash``
    (an explicit backend wins, as Megatron-LM's launch scripts pass both)."""
    requested = cfg.model.attention_backend
    return "flash" if requested == "auto" and cfg.megatron.use_flash_attn else requested


class SDPACoreAttention(DotProductAttention):
    """megatron-core's DotProductAttention with its forward through torch SDPA."""

    def _megatron_only(self, attention_bias, packed_seq_params) -> bool:
        """Features megatron-core's forward handles (or refuses) itself: layer-scaled
        softmax, sliding windows, softmax offsets, attention bias, packed sequences."""
        c = self.config
        return (attention_bias is not None or packed_seq_params is not None or c.apply_query_key_layer_scaling
                or self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None)

    def _grouped_kv_native(self, query, attention_mask) -> bool:
        """Whether SDPA takes grouped K/V heads as they are (here: no, repeated as megatron-core does)."""
        return False

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self._megatron_only(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        gqa = rep > 1 and self._grouped_kv_native(query, attention_mask)
        if rep > 1 and not gqa:  # [s, b, groups, d] -> [s, b, heads, d], as megatron-core repeats them
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
                out = self._sdpa(q, k, v, mask, causal, p, gqa)
        else:
            out = self._sdpa(q, k, v, mask, causal, p, gqa)
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, mask, causal, p, gqa=False):
        extra = {"enable_gqa": True} if gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.softmax_scale, **extra)


class CudaSDPACoreAttention(SDPACoreAttention):
    """SDPACoreAttention on a GPU host: SDPA's fused kernels only (module docstring)."""

    _refused: set = set()  # call shapes no fused kernel accepted (each logged once)

    def _grouped_kv_native(self, query, attention_mask) -> bool:
        return (attention_mask is None and query.dtype in (torch.float16, torch.bfloat16)
                and query.size(-1) <= FLASH_MAX_HEAD_DIM)

    def _sdpa(self, q, k, v, mask, causal, p, gqa=False):
        shape = (q.dtype, q.size(-1), mask is not None, gqa, p > 0.0)
        if shape not in self._refused:
            try:
                with sdpa_kernel(list(FUSED_KERNELS)):
                    return super()._sdpa(q, k, v, mask, causal, p, gqa)
            except RuntimeError as e:
                if not any(text in str(e) for text in NO_KERNEL):
                    raise
                self._refused.add(shape)
                log.warning("notice: no fused SDPA kernel takes attention with dtype %s, head dim %d, mask %s, "
                            "grouped K/V %s, dropout %s; SDPA's own choice is used (memory may be quadratic in s)",
                            *shape)
        return super()._sdpa(q, k, v, mask, causal, p, gqa)


def core_attention_class(backend: str, platform=None):
    """The core-attention module a resolved backend name selects on local layers (a GPU
    host's SDPA class when ``platform`` is CUDA)."""
    if backend not in SDPA_BACKENDS:
        return DotProductAttention
    return CudaSDPACoreAttention if platform is not None and platform.is_cuda else SDPACoreAttention
