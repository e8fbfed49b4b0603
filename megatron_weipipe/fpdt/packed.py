"""Attention blocks of packed documents: per-block kernel choice, and tiled Ulysses.

Each (query range, key range) block is classified by ``Documents.classify``: skipped
blocks cost nothing, a block inside one document runs the backend's flash kernel
(non-causal, or causal on the diagonal), and a block that a boundary cuts runs that
kernel once per document rectangle inside it (varlen-style; each query and key lies in
one rectangle, so results are placed, not merged), or, when the documents are shorter
than ``MIN_SEGMENT`` rows on average, the math kernel with a boolean block mask. Rows of a masked block that see no key get
lse = -inf and out = 0; the diagonal block, always merged first, gives every row a
finite lse, so the online-softmax merge never meets -inf on both sides (no NaN).

Plain Ulysses holds the whole sequence in one block, so with documents it is cut into
tiles (``DocumentAttention``): the same classification per tile pair keeps memory at
one tile pair's scores and skips what no document spans.
"""

from __future__ import annotations

import torch

from megatron_weipipe.fpdt.documents import CAUSAL, MASKED, SKIP, Documents
from megatron_weipipe.fpdt.kernels import MathKernel, acc_dtype, merge

_MATH = MathKernel()
DEFAULT_TILE = 2048


MIN_SEGMENT = 64  # mean query rows per document rectangle below which a masked block uses the mask


def _segments(docs: Documents, rng, batch: int):
    """The block's document rectangles, or None when they are too small to pay per call."""
    segs = docs.segments(*rng)
    n = sum(len(s) for s in segs)
    return segs if n and batch * (rng[1] - rng[0]) >= MIN_SEGMENT * n else None


def block_forward(kern, q, k, v, kind: str, docs: Documents | None, rng, scale: float):
    """(out, lse) of one block; ``rng`` = (q0, q1, k0, k1) global positions."""
    if kind != MASKED:
        return kern.forward(q, k, v, kind == CAUSAL, scale)
    segs = _segments(docs, rng, q.shape[0])
    if segs is None:
        return _MATH.forward(q, k, v, False, scale, visible=docs.visible(*rng, device=q.device))
    causal = rng[0] == rng[2]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for r, row in enumerate(segs):
        for qa, qe, ka, ke in row:
            o_s, l_s = kern.forward(q[r : r + 1, :, qa:qe], k[r : r + 1, :, ka:ke], v[r : r + 1, :, ka:ke], causal, scale)
            out[r : r + 1, :, qa:qe] = o_s
            lse[r : r + 1, :, qa:qe] = l_s
    return out, lse


def block_backward(kern, do, q, k, v, o, lse, kind: str, docs: Documents | None, rng, scale: float):
    """This block's share of (dq, dk, dv) given the final merged out and lse."""
    if kind != MASKED:
        return kern.backward(do, q, k, v, o, lse, kind == CAUSAL, scale)
    segs = _segments(docs, rng, q.shape[0])
    if segs is None:
        return _MATH.backward(do, q, k, v, o, lse, False, scale, visible=docs.visible(*rng, device=q.device))
    causal = rng[0] == rng[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r, row in enumerate(segs):
        for qa, qe, ka, ke in row:
            s = slice(r, r + 1)
            g = kern.backward(do[s, :, qa:qe], q[s, :, qa:qe], k[s, :, ka:ke], v[s, :, ka:ke],
                              o[s, :, qa:qe], lse[s, :, qa:qe], causal, scale)
            dq[s, :, qa:qe], dk[s, :, ka:ke], dv[s, :, ka:ke] = g
    return dq, dk, dv


def _tiles(S: int, tile: int):
    return [(a, min(a + tile, S)) for a in range(0, S, tile)]


class DocumentAttention(torch.autograd.Function):
    """Causal attention within documents of full-sequence q [b, hq, S, d], k/v [b, hkv, S, d]
    (Ulysses after its all-to-all), tile by tile with block skipping."""

    @staticmethod
    def forward(ctx, q, k, v, kern, scale, docs: Documents, tile: int):
        S = q.shape[2]
        acc = acc_dtype(q.dtype)
        tiles = _tiles(S, tile)
        outs, lses = [], []
        for t, (a, e) in enumerate(tiles):
            qt = q[:, :, a:e]
            kind = docs.classify(a, e, a, e)
            docs.counts[kind] += 1
            o, lse = block_forward(kern, qt, k[:, :, a:e], v[:, :, a:e], kind, docs, (a, e, a, e), scale)
            if t > 0:
                o = o.to(acc)
            for c, f in tiles[:t]:
                kind = docs.classify(a, e, c, f)
                docs.counts[kind] += 1
                if kind == SKIP:
                    continue
                o_b, l_b = block_forward(kern, qt, k[:, :, c:f], v[:, :, c:f], kind, docs, (a, e, c, f), scale)
                o, lse = merge(o, lse, o_b, l_b)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kern, ctx.scale, ctx.docs, ctx.tile = kern, scale, docs, tile
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kern, scale, docs = ctx.kern, ctx.scale, ctx.docs
        dout = dout.contiguous()
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        tiles = _tiles(q.shape[2], ctx.tile)
        for t, (a, e) in enumerate(tiles):
            args = (dout[:, :, a:e], q[:, :, a:e])
            o_t, l_t = out[:, :, a:e], lse[:, :, a:e]
            for c, f in tiles[: t + 1]:
                kind = docs.classify(a, e, c, f)
                if kind == SKIP:
                    continue
                g = block_backward(kern, *args, k[:, :, c:f], v[:, :, c:f], o_t, l_t, kind, docs, (a, e, c, f), scale)
                dq[:, :, a:e] += g[0]
                dk[:, :, c:f] += g[1]
                dv[:, :, c:f] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
