"""Attention blocks of packed documents: per-block kernel choice, and tiled Ulysses.

Each (query range, key range) block is classified by ``Documents.classify``: skipped
blocks cost nothing, a block inside one document runs the backend's flash kernel
(non-causal, or causal on the diagonal), and a block that a boundary cuts runs ONE
varlen call over all its document rectangles, every sample at once (``fpdt.varlen``:
flash varlen on a GPU, a padded-batch reference elsewhere); each query and key lies in
one rectangle, so results are placed, not merged. Where the padded reference would hold
more score entries than the block itself, the math kernel with a boolean block mask
runs instead (also one call). Rows of a masked block that see no key get lse = -inf and
out = 0; the diagonal block, always merged first, gives every row a finite lse, so the
online-softmax merge never meets -inf on both sides (no NaN).

Plain Ulysses holds the whole sequence in one block, so with documents it is cut into
tiles (``DocumentAttention``): the same classification per tile pair keeps memory at
one tile pair's scores and skips what no document spans.
"""

from __future__ import annotations

import torch

from megatron_weipipe.fpdt.documents import CAUSAL, MASKED, SKIP, Documents
from megatron_weipipe.fpdt.kernels import MathKernel, acc_dtype, merge
from megatron_weipipe.fpdt.varlen import REFERENCE, varlen_backend

_MATH = MathKernel()
DEFAULT_TILE = 2048
# The padded reference runs while its score entries are at most PAD_RATIO x the block's
# (tests set 0: always the block mask, inf: always varlen).
PAD_RATIO = 1.0


def masked_plan(kern, docs: Documents, rng, q: torch.Tensor, sk: int):
    """(varlen backend, layout) of a masked block, or None where the block-masked math
    kernel holds fewer score entries than the padded reference would."""
    backend = varlen_backend(kern, q)
    lay = docs.varlen(*rng)  # on the host: its sizes decide
    if backend is REFERENCE and lay.padded_entries > PAD_RATIO * q.shape[0] * q.shape[2] * sk:
        return None
    return backend, docs.varlen(*rng, device=q.device, padded=backend is REFERENCE)


def block_forward(kern, q, k, v, kind: str, docs: Documents | None, rng, scale: float):
    """(out, lse) of one block; ``rng`` = (q0, q1, k0, k1) global positions."""
    if kind != MASKED:
        return kern.forward(q, k, v, kind == CAUSAL, scale)
    plan = masked_plan(kern, docs, rng, q, k.shape[2])
    if plan is None:
        return _MATH.forward(q, k, v, False, scale, visible=docs.visible(*rng, device=q.device))
    backend, lay = plan
    out, lse = backend.forward(q, k, v, lay, rng[0] == rng[2], scale)
    return out, lse.to(acc_dtype(q.dtype))


def block_backward(kern, do, q, k, v, o, lse, kind: str, docs: Documents | None, rng, scale: float):
    """This block's share of (dq, dk, dv) given the final merged out and lse."""
    if kind != MASKED:
        return kern.backward(do, q, k, v, o, lse, kind == CAUSAL, scale)
    plan = masked_plan(kern, docs, rng, q, k.shape[2])
    if plan is None:
        return _MATH.backward(do, q, k, v, o, lse, False, scale, visible=docs.visible(*rng, device=q.device))
    backend, lay = plan
    return backend.backward(do, q, k, v, o, lse, lay, rng[0] == rng[2], scale)


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
