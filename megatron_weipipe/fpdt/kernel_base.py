"""The block-attention kernel interface, its math reference, and GQA without K/V copies.

Shapes: q [b, Hq, sq, d], k/v [b, Hkv, sk, d] with Hq a multiple of Hkv (query head h
uses KV head h // (Hq/Hkv), Megatron's grouping). ``forward`` returns (out, lse) with
out in q's dtype and lse [b, Hq, sq] in the accumulation dtype (float64 for float64
inputs, float32 otherwise). ``backward(dout, q, k, v, out, lse)`` takes the FINAL
(merged over all key blocks) out and lse, so it returns this block's exact share of
dq, dk, dv: p = exp(s - lse_final), ds = p * (dout @ v^T - rowsum(dout * out_final)).

``causal`` means the square diagonal block (query i sees keys <= i): FPDT's diagonal
chunk pair, and the document squares inside it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from collections import Counter

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for softmax statistics and partial sums."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate_matmul(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b with acc in the accumulation dtype; in place (no temporary) when the
    dtypes already match, which is what keeps weight-gradient sums over chunks cheap."""
    if acc is None:
        return (a @ b).to(acc_dtype(a.dtype))
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    return acc.add_(a @ b)


def merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor):
    """Online-softmax merge of a block into running (out, lse), in acc_out's dtype.

    lse' = lse + log1p(exp(lse_blk - lse)) written symmetrically (stable for either larger);
    out' = exp(lse - lse') * out + exp(lse_blk - lse') * out_blk.
    """
    dt = acc_out.dtype
    a, bl = acc_lse.to(dt), blk_lse.to(dt)
    hi = torch.maximum(a, bl)
    new = hi + torch.log1p(torch.exp(-(a - bl).abs()))
    out = torch.exp(a - new).unsqueeze(-1) * acc_out + torch.exp(bl - new).unsqueeze(-1) * blk_out.to(dt)
    return out, new


# Largest self_check error (unit-variance inputs, s = 128) that still counts as the same
# attention: a wrong mask, layout or grouping gives errors of order 1.
SELF_CHECK_TOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where masked (key after query), bottom-right aligned."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def scores_bytes(block, dtype: torch.dtype) -> int:
    """Bytes of one block's scores as the math kernel holds them: b * heads * sq * sk
    elements of the accumulation dtype (its backward holds about three such tensors)."""
    b, heads, sq, sk = block
    return b * heads * sq * sk * torch.empty((), dtype=acc_dtype(dtype)).element_size()


class MathKernel:
    """Reference-grade kernel: scores for one block materialised in the accumulation dtype."""

    name = "math"

    def __init__(self):
        self.counts: Counter = Counter()

    def prepare(self, device, dtype, head_dim) -> None:
        """Nothing to probe."""

    def _scores(self, q, k, causal, scale, visible=None):
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        g = hq // hkv
        acc = acc_dtype(q.dtype)
        # Query heads of one KV group are adjacent: fold them into the row dimension.
        qg = q.reshape(b, hkv, g * sq, d).to(acc)
        s = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale
        if causal:
            m = _causal_mask(sq, sk, q.device)
            s = s.view(b, hkv, g, sq, sk).masked_fill(m, float("-inf")).view(b, hkv, g * sq, sk)
        if visible is not None:  # [b, sq, sk] block mask of packed documents
            s = s.view(b, hkv, g, sq, sk).masked_fill(~visible[:, None, None], float("-inf")).view(b, hkv, g * sq, sk)
        return qg, s

    def forward(self, q, k, v, causal: bool, scale: float, visible=None):
        """``visible`` [b, sq, sk] masks a block; rows that see no key get out 0, lse -inf."""
        b, hq, sq, d = q.shape
        _, s = self._scores(q, k, causal, scale, visible)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        safe = lse.masked_fill(torch.isinf(lse), 0.0) if visible is not None else lse
        out = torch.matmul(torch.exp(s - safe), v.to(s.dtype))
        return out.view(b, hq, sq, -1).to(q.dtype), lse.view(b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, visible=None):
        b, hq, sq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qg, s = self._scores(q, k, causal, scale, visible)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).reshape(b, hkv, g * sq, 1))
        do = dout.reshape(b, hkv, g * sq, -1).to(acc)
        delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, hkv, g * sq, 1)
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qg) * scale
        return dq.view(b, hq, sq, d), dk, dv


def fold_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, Hq, s, ...] -> [b, Hkv, g*s, ...]: the g query heads of a KV head become rows
    (a view when ``t`` is contiguous, as q, o, do and lse of a chunk are)."""
    b, hq = t.shape[:2]
    return t.reshape(b, hkv, (hq // hkv) * t.shape[2], *t.shape[3:])


def unfold_heads(t: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of fold_heads: [b, Hkv, g*s, ...] -> [b, Hq, s, ...]."""
    b, hkv = t.shape[:2]
    return t.reshape(b, hq, t.shape[2] // (hq // hkv), *t.shape[3:])


def expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, Hkv, s, d] -> [b, Hkv*groups, s, d], KV head j serving query heads j*g .. j*g+g-1."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def reduce_kv(dk: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of expand_kv for gradients: the sum over each KV head's query heads."""
    return dk if groups == 1 else dk.unflatten(1, (dk.shape[1] // groups, groups)).sum(dim=2)


class GroupedKernel(ABC):
    """Base of the fused kernels: GQA handled once here, the op called on equal heads.

    Subclasses give ``_forward``/``_backward`` for q and K/V of equal head counts (or of
    any, where ``native_gqa_for`` says the op groups heads itself, probed once). Otherwise a
    non-causal block folds the g query heads of each KV head into rows (``fold_heads``):
    no K/V copy, dk/dv come out per KV head, the result is row for row the same. Only
    the causal block, the diagonal one that each KV chunk meets once per pass, expands
    K/V (and reduces dk/dv); ``counts["kv_expand"]`` tallies those expansions.
    """

    name = ""
    top_left_causal = True  # torch's CPU flash, cuDNN and memory-efficient ops; FlashAttention-2 is bottom-right

    def __init__(self):
        self.counts: Counter = Counter()

    def prepare(self, device, dtype, head_dim) -> None:
        """Run the one-off probes before the first block call (outside forward/backward)."""

    def _check_causal(self, q, k, causal):
        """Top-left and bottom-right causal masks agree on square blocks only (FPDT's)."""
        if causal and self.top_left_causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"kernel {self.name} aligns its causal mask top-left: causal blocks must be square, "
                             f"got {q.shape[2]} queries x {k.shape[2]} keys")

    def native_gqa_for(self, q: torch.Tensor) -> bool:
        """Does the op group query heads over fewer K/V heads itself (for q's dtype and head_dim)?"""
        return False

    @abstractmethod
    def _forward(self, q, k, v, causal: bool, scale: float):
        """(out, lse) of the op for equal head counts (or grouped ones, see native_gqa_for)."""

    @abstractmethod
    def _backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """(dq, dk, dv) of the op, given the final out and lse."""

    def forward(self, q, k, v, causal: bool, scale: float):
        self._check_causal(q, k, causal)
        hq, hkv = q.shape[1], k.shape[1]
        g = hq // hkv
        if g == 1 or self.native_gqa_for(q):
            return self._forward(q, k, v, causal, scale)
        if not causal:
            out, lse = self._forward(fold_heads(q, hkv), k, v, False, scale)
            return unfold_heads(out, hq), unfold_heads(lse, hq)
        self.counts["kv_expand"] += 1
        return self._forward(q, expand_kv(k, g), expand_kv(v, g), True, scale)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        self._check_causal(q, k, causal)
        hq, hkv = q.shape[1], k.shape[1]
        g = hq // hkv
        if g == 1 or self.native_gqa_for(q):
            return self._backward(dout, q, k, v, out, lse, causal, scale)
        if not causal:
            f = lambda t: fold_heads(t.contiguous(), hkv)  # noqa: E731
            dq, dk, dv = self._backward(f(dout), f(q), k, v, f(out), f(lse), False, scale)
            return unfold_heads(dq, hq), dk, dv
        self.counts["kv_expand"] += 1
        self.counts["dkv_reduce"] += 1
        dq, dk, dv = self._backward(dout, q, expand_kv(k, g), expand_kv(v, g), out, lse, True, scale)
        return dq, reduce_kv(dk, g), reduce_kv(dv, g)


def self_check(kernel, device, dtype, b=1, hq=4, hkv=2, s=128, d=64, seed=0) -> float:
    """Largest abs difference of (out, lse, dq, dk, dv) of ``kernel`` against the math
    kernel on random inputs, split into a full and a causal key block merged by
    log-sum-exp (so GQA's folded and expanded paths both run). Used by ``auto`` on CUDA
    at first use, by the acceptance checks and by the GPU benchmark."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(b, hq, s, d), mk(b, hkv, 2 * s, d), mk(b, hkv, 2 * s, d), mk(b, hq, s, d)
    scale = d**-0.5
    ref = MathKernel()
    errs = []
    outs = []
    for kern in (kernel, ref):
        o0, l0 = kern.forward(q, k[:, :, :s], v[:, :, :s], False, scale)
        o1, l1 = kern.forward(q, k[:, :, s:], v[:, :, s:], True, scale)
        o, lse = merge(o0.float(), l0.float(), o1, l1.float())
        o = o.to(dtype)
        g0 = kern.backward(do, q, k[:, :, :s], v[:, :, :s], o, lse, False, scale)
        g1 = kern.backward(do, q, k[:, :, s:], v[:, :, s:], o, lse, True, scale)
        dq = g0[0].float() + g1[0].float()
        dk = torch.cat([g0[1].float(), g1[1].float()], 2)
        dv = torch.cat([g0[2].float(), g1[2].float()], 2)
        outs.append((o.float(), lse, dq, dk, dv))
    for a, r in zip(*outs):
        if a.shape != r.shape:
            raise RuntimeError(f"kernel {kernel.name} returned shape {tuple(a.shape)}, the math kernel {tuple(r.shape)}")
        err = (a - r).abs().max().item()
        errs.append(err if math.isfinite(err) else math.inf)  # max() would pass over a NaN
    return max(errs)
