"""Single-process, unsharded, unchunked references for tests, and the inputs the attention tests share.

The attention reference shares no code with the FPDT path: it splits the fused QKV the
way megatron.core's SelfAttention does, applies megatron.core's own rotary functions, and
runs torch's scaled_dot_product_attention on the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_weipipe.fpdt.config import AttentionSpec


def megatron_rotary_emb(spec: AttentionSpec, seq_len: int) -> torch.Tensor:
    """Megatron's rotary angle table [S, 1, 1, rot_dim] (built on CPU)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    r = spec.rotary
    rope = RotaryEmbedding(
        kv_channels=spec.head_dim,
        rotary_percent=r.percent,
        rotary_interleaved=r.interleaved,
        seq_len_interpolation_factor=r.seq_len_interpolation_factor,
        rotary_base=r.base,
        rope_scaling=r.rope_scaling,
        rope_scaling_factor=r.rope_scaling_factor,
        use_cpu_initialization=True,
    )
    freqs = rope.get_freqs_non_repeated(seq_len)  # get_emb itself moves inv_freq to CUDA
    if r.interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def reference_attention(x, w_qkv, b_qkv, w_proj, b_proj, spec: AttentionSpec, attn_mask=None) -> torch.Tensor:
    """Causal self-attention of the full sequence x [S, b, hidden] (autograd-able).

    ``attn_mask``: a dense boolean mask broadcastable to [b, heads, S, S], True where a
    query may attend (packed documents), used instead of plain causality."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    S, b, _ = x.shape
    ng, g, d = spec.groups, spec.heads_per_group, spec.head_dim
    mixed = F.linear(x, w_qkv, b_qkv).view(S, b, ng, (g + 2) * d)
    q, k, v = torch.split(mixed, [g * d, d, d], dim=3)
    q = q.reshape(S, b, ng * g, d)
    if spec.rotary is not None:
        emb = megatron_rotary_emb(spec, S).to(x.device)
        q = _apply_rotary_pos_emb_bshd(q, emb, rotary_interleaved=spec.rotary.interleaved)
        k = _apply_rotary_pos_emb_bshd(k, emb, rotary_interleaved=spec.rotary.interleaved)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if attn_mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=spec.scale, enable_gqa=True)
    o = o.permute(2, 0, 1, 3).reshape(S, b, -1)
    return F.linear(o, w_proj, b_proj)


# Inputs shared by the attention tests (test_fpdt_attention.py, test_fpdt_packed.py).
HIDDEN = 32
HEAD_DIM = 8


def make_case(S, b, spec: AttentionSpec, bias: bool, seed: int):
    """Full-sequence inputs in float64; a per-position ramp makes every chunk's data distinct."""
    gen = torch.Generator().manual_seed(seed)
    d64 = torch.float64

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=d64) * scale

    pos = torch.arange(S, dtype=d64)
    x = rnd(S, b, HIDDEN) + (pos / S)[:, None, None] + 0.3 * torch.sin(pos)[:, None, None]
    return dict(
        x=x,
        wq=rnd(spec.qkv_size, HIDDEN, scale=HIDDEN**-0.5),
        bq=rnd(spec.qkv_size, scale=0.1) if bias else None,
        wp=rnd(HIDDEN, spec.proj_input_size, scale=spec.proj_input_size**-0.5),
        bp=rnd(HIDDEN, scale=0.1) if bias else None,
        dy=rnd(S, b, HIDDEN) * (1 + pos / S)[:, None, None],
    )


def scaled_error(a, ref) -> float:
    """Max absolute error of ``a`` scaled by the largest reference value (at least 1)."""
    return ((a.double() - ref).abs().max() / max(1.0, ref.abs().max().item())).item()
