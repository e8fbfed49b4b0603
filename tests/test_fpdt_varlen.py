"""Packed documents as one varlen call per masked block (fpdt/varlen.py).

* The packed layout built from the offsets by tensor ops names exactly the document
  rectangles that ``Documents.segments`` lists one by one.
* The padded reference's (out, lse, dq, dk, dv) of a masked block equal a dense masked
  attention through autograd in float64 within 1e-10 (diagonal block with causal
  document squares, earlier key block with one rectangle per sample, GQA).
* FPDT attention (4 chunks, the online-softmax merge across chunk pairs) with every
  masked block as one varlen call equals whole-sequence attention under megatron-core's
  dense document mask in float64 within 1e-10, with and without offload.
* The flash-varlen adapter, on a CPU stand-in for torch's varlen op (a per-document
  loop over torch's CPU flash op, sharing no code with the reference), gives the
  reference's values: layout, lse transposition and placement are right.

Chunks are filled with different random values (each position its own draw), so a
chunk or document placed at the wrong offset changes the result.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, RotaryConfig, fpdt_attention
from megatron_weipipe.fpdt import packed, varlen
from megatron_weipipe.fpdt.documents import MASKED, Documents
from megatron_weipipe.fpdt.varlen import REFERENCE, FlashVarlen, build_layout, varlen_backend
from fpdt_reference import HEAD_DIM, HIDDEN, make_case, reference_attention, scaled_error

TOL64 = 1e-10
OFFSETS = torch.tensor([[0, 1, 4, 5, 11, 24, 25, 32, 32], [0, 9, 10, 32, 32, 32, 32, 32, 32]])


def _dense_block(q, k, v, do, visible, scale):
    """Masked attention of one block through autograd: out, lse, dq, dk, dv (rows that see
    no key: out 0, lse -inf, no gradient)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kx.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    seen = visible.any(-1)[:, None, :, None]
    p = torch.where(seen, torch.softmax(s.masked_fill(~seen, 0.0), -1), torch.zeros_like(s))
    out = p @ vx
    (out * do).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def test_layout_names_the_rectangles_segments_lists():
    docs = Documents(OFFSETS)
    for rng in ((0, 16, 0, 16), (16, 32, 16, 32), (16, 32, 0, 16), (8, 12, 0, 8), (24, 32, 8, 16)):
        lay = build_layout(docs.offsets, *rng)
        sq, sk = rng[1] - rng[0], rng[3] - rng[2]
        want_q, want_k, want_len = [], [], []
        for r, segs in enumerate(docs.segments(*rng)):
            for qa, qe, ka, ke in segs:
                want_q += [r * sq + i for i in range(qa, qe)]
                want_k += [r * sk + i for i in range(ka, ke)]
                want_len.append((qe - qa, ke - ka))
        assert lay.q_rows.tolist() == want_q and lay.k_rows.tolist() == want_k, rng
        lens = list(zip(lay.cu_q.diff().tolist(), lay.cu_k.diff().tolist()))
        assert lens == want_len, rng
        if want_len:
            assert (lay.max_q, lay.max_k) == tuple(max(x) for x in zip(*want_len))


@pytest.mark.parametrize("rng", [(16, 32, 16, 32), (16, 32, 0, 16), (0, 16, 0, 16)])
def test_reference_block_matches_dense_masked_float64(rng):
    docs = Documents(OFFSETS)
    assert docs.classify(*rng) == MASKED
    gen = torch.Generator().manual_seed(sum(rng))
    b, hq, hkv, d = 2, 4, 2, 8
    sq, sk = rng[1] - rng[0], rng[3] - rng[2]
    mk = lambda h, s: torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, do = mk(hq, sq), mk(hkv, sk), mk(hkv, sk), mk(hq, sq)
    scale = d**-0.5
    lay = docs.varlen(*rng)
    causal = rng[0] == rng[2]
    o, lse = REFERENCE.forward(q, k, v, lay, causal, scale)
    grads = REFERENCE.backward(do, q, k, v, o, lse, lay, causal, scale)
    want = _dense_block(q, k, v, do, docs.visible(*rng), scale)
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))
    if not causal:
        assert torch.isinf(lse).any()  # rows that see no key of an earlier block occur
    fin = torch.isfinite(want[1])
    assert (lse[fin] - want[1][fin]).abs().max() < TOL64
    for got, ref in zip((o, *grads), (want[0], *want[2:])):
        assert got.shape == ref.shape
        assert (got - ref).abs().max() < TOL64


def _fpdt_case(seed: int, dtype=torch.float64):
    spec = AttentionSpec(HIDDEN, 4, HEAD_DIM, 2, rotary=RotaryConfig())
    case = make_case(32, 2, spec, True, seed)
    return spec, case


def _dense_mask(offsets):
    docs = Documents(offsets)
    return docs.visible(0, docs.seq_len, 0, docs.seq_len)[:, None]


@pytest.mark.parametrize("offload", [False, True])
def test_fpdt_with_varlen_blocks_matches_dense_reference_float64(monkeypatch, offload):
    monkeypatch.setattr(packed, "PAD_RATIO", math.inf)  # every masked block: one varlen call
    calls = []
    plain = varlen.ReferenceVarlen.forward
    monkeypatch.setattr(varlen.ReferenceVarlen, "forward", lambda self, *a: calls.append(a[3]) or plain(self, *a))
    spec, case = _fpdt_case(3 + offload)
    leaves = {k: v.clone().requires_grad_(True) for k, v in case.items() if k != "dy"}
    ref = reference_attention(leaves["x"], leaves["wq"], leaves["bq"], leaves["wp"], leaves["bp"], spec,
                              attn_mask=_dense_mask(OFFSETS))
    ref.backward(case["dy"])
    p = {k: case[k].clone().requires_grad_(True) for k in ("x", "wq", "bq", "wp", "bp")}
    docs = Documents(OFFSETS)
    out = fpdt_attention(p["x"], p["wq"], p["bq"], p["wp"], p["bp"], spec, FPDTConfig(chunk_size=8, offload=offload),
                         documents=docs)
    out.backward(case["dy"])
    assert docs.counts[MASKED] >= 4 and docs.counts["skip"] >= 1, docs.counts
    assert len(calls) == docs.counts[MASKED]  # one call per masked block, whatever its documents
    assert len({id(c) for c in calls}) == len(calls)  # one layout per block, built once
    assert scaled_error(out.detach(), ref.detach()) < TOL64
    for k in p:
        assert scaled_error(p[k].grad, leaves[k].grad) < TOL64, k


class _FakeVarlenOp:
    """torch's varlen flash op pair on the CPU: per document, torch's CPU flash op."""

    CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def __init__(self):
        self.calls = 0

    @staticmethod
    def _docs(cu):
        return list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None, **unused):
        self.calls += 1
        g = query.shape[1] // key.shape[1]
        out, lse = torch.empty_like(query), torch.empty(query.shape[1], query.shape[0])
        for (a, e), (c, f) in zip(self._docs(cum_seq_q), self._docs(cum_seq_k)):
            qd = query[a:e].transpose(0, 1)[None]
            kd, vd = (t[c:f].transpose(0, 1)[None].repeat_interleave(g, 1) for t in (key, value))
            o, l = self.CPU(qd, kd, vd, 0.0, is_causal, scale=scale)
            out[a:e], lse[:, a:e] = o[0].transpose(0, 1), l[0]
        z = torch.zeros(2, dtype=torch.long)
        return out, lse, z, z, torch.empty(0)

    def backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, rng_state, unused, *, scale=None, **extra):
        g = query.shape[1] // key.shape[1]
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for (a, e), (c, f) in zip(self._docs(cum_seq_q), self._docs(cum_seq_k)):
            t = lambda x, s, n=1: x[s].transpose(0, 1)[None].repeat_interleave(n, 1).contiguous()  # noqa: E731
            qs, ks = slice(a, e), slice(c, f)
            gq, gk, gv = self.CPU_BWD(t(grad_out, qs), t(query, qs), t(key, ks, g), t(value, ks, g), t(out, qs),
                                      logsumexp[None, :, a:e].contiguous(), 0.0, is_causal, scale=scale)
            dq[qs] = gq[0].transpose(0, 1)
            dk[ks] = gk[0].unflatten(0, (key.shape[1], g)).sum(1).transpose(0, 1)
            dv[ks] = gv[0].unflatten(0, (key.shape[1], g)).sum(1).transpose(0, 1)
        return dq, dk, dv


@pytest.mark.parametrize("rng", [(16, 32, 16, 32), (16, 32, 0, 16)])
def test_flash_varlen_adapter_on_a_stand_in_op(monkeypatch, rng):
    fake = _FakeVarlenOp()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake.backward)
    docs = Documents(OFFSETS)
    gen = torch.Generator().manual_seed(7)
    mk = lambda h, s: torch.randn(2, h, s, 16, generator=gen)  # noqa: E731
    sq, sk = rng[1] - rng[0], rng[3] - rng[2]
    q, k, v, do = mk(4, sq), mk(2, sk), mk(2, sk), mk(4, sq)
    lay, causal = docs.varlen(*rng), rng[0] == rng[2]
    flash = FlashVarlen()
    got = flash.forward(q, k, v, lay, causal, 0.25)
    got = (*got, *flash.backward(do, q, k, v, *got, lay, causal, 0.25))
    want = REFERENCE.forward(q.double(), k.double(), v.double(), lay, causal, 0.25)
    want = (*want, *REFERENCE.backward(do.double(), q.double(), k.double(), v.double(), *want, lay, causal, 0.25))
    assert fake.calls == 1  # the whole block, both samples, in one call
    for a, r in zip(got, want):
        fin = torch.isfinite(r)
        assert torch.equal(fin, torch.isfinite(a))
        assert (a.double()[fin] - r[fin]).abs().max() < 1e-5


def test_backend_choice_on_cpu_is_the_reference():
    assert varlen_backend(object(), torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)) is REFERENCE
    assert varlen_backend(object(), torch.zeros(1, 2, 4, 64, dtype=torch.float64)) is REFERENCE


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_cpu_flash_padded_reference_matches_math_float64(dtype, tol):
    """CPU float32/bf16 run the padded batch through torch's CPU flash op with a key mask."""
    docs = Documents(OFFSETS)
    gen = torch.Generator().manual_seed(11)
    for rng in ((16, 32, 16, 32), (16, 32, 0, 16)):
        mk = lambda h: torch.randn(2, h, 16, 16, generator=gen, dtype=torch.float64)  # noqa: E731
        q, k, v, do = mk(4), mk(2), mk(2), mk(4)
        lay, causal = docs.varlen(*rng), rng[0] == rng[2]
        lo = [t.to(dtype) for t in (q, k, v, do)]
        o, lse = REFERENCE.forward(*lo[:3], lay, causal, 0.25)
        got = (o, lse, *REFERENCE.backward(lo[3], *lo[:3], o, lse, lay, causal, 0.25))
        o64, l64 = REFERENCE.forward(q, k, v, lay, causal, 0.25)
        want = (o64, l64, *REFERENCE.backward(do, q, k, v, o64, l64, lay, causal, 0.25))
        for a, r in zip(got, want):
            fin = torch.isfinite(r)
            assert torch.equal(fin, torch.isfinite(a))
            assert (a.double()[fin] - r[fin]).abs().max() < tol
