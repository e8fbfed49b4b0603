"""Chunked MLP and chunked output layer + cross-entropy against unchunked references."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_weipipe.fpdt import chunked_cross_entropy, chunked_mlp, reference_cross_entropy, reference_mlp
from harness import run_distributed

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (an exact, machine-independent count)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _err(a, ref):
    return ((a.double() - ref.double()).abs().max() / max(1.0, ref.abs().max().item())).item()


def _mlp_params(h, ffn, gated, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(ffn * (2 if gated else 1), h, generator=g, dtype=torch.float64) * h**-0.5
    w2 = torch.randn(h, ffn, generator=g, dtype=torch.float64) * ffn**-0.5
    b1 = torch.randn(w1.shape[0], generator=g, dtype=torch.float64) * 0.1 if bias else None
    b2 = torch.randn(h, generator=g, dtype=torch.float64) * 0.1 if bias else None
    return [None if t is None else t.to(dtype).requires_grad_(True) for t in (w1, b1, w2, b2)]


def _mlp_grads(fn, x, params, dy):
    x = x.clone().requires_grad_(True)
    for p in params:
        if p is not None:
            p.grad = None
    out = fn(x, *params)
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in params if p is not None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "gelu_tanh", "geglu"])
def test_chunked_mlp_matches_unchunked(activation, dtype):
    gated = activation in ("swiglu", "geglu")
    for chunks, b, bias in ((1, 1, True), (2, 2, False), (4, 2, True), (8, 1, False)):
        s, h, ffn = 16, 16, 24
        g = torch.Generator().manual_seed(chunks)
        x = (torch.randn(s, b, h, generator=g, dtype=torch.float64) + torch.arange(s)[:, None, None] / s).to(dtype)
        dy = torch.randn(s, b, h, generator=g, dtype=torch.float64).to(dtype)
        params = _mlp_params(h, ffn, gated, bias, dtype, seed=chunks)
        ref = _mlp_grads(lambda x, *p: reference_mlp(x, *p, activation), x, params, dy)
        got = _mlp_grads(lambda x, *p: chunked_mlp(x, *p, activation, num_chunks=chunks), x, params, dy)
        for a, r in zip(got, ref):
            assert _err(a, r) <= TOL[dtype], (activation, chunks, b, bias)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_before_chunked_mlp_still_backprops(norm):
    """DeepSpeed #7706: the public chunked MLP overwrote its saved input in its backward,
    so the norm that saved the same tensor failed. Here the input is never written."""
    s, b, h, ffn = 16, 2, 16, 32
    torch.manual_seed(0)
    x = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    norm_mod = torch.nn.LayerNorm(h, dtype=torch.float64) if norm == "layernorm" else torch.nn.RMSNorm(h, dtype=torch.float64)
    params = _mlp_params(h, ffn, True, False, torch.float64, seed=1)
    dy = torch.randn(s, b, h, dtype=torch.float64)

    def run(fn):
        x.grad = None
        y = norm_mod(x)
        version = y._version
        out = fn(y) + y  # the residual also reads the norm output
        out.backward(dy)
        assert y._version == version  # nothing wrote into the saved tensor
        return x.grad.clone()

    ref = run(lambda y: reference_mlp(y, *params, "swiglu"))
    got = run(lambda y: chunked_mlp(y, *params, "swiglu", num_chunks=4))
    assert _err(got, ref) <= 1e-10


def test_chunked_mlp_intermediate_is_one_chunk_wide():
    s, b, h, ffn, chunks = 32, 2, 8, 64, 8
    params = _mlp_params(h, ffn, True, True, torch.float32, seed=2)
    x = torch.randn(s, b, h, requires_grad=True)
    with LargestTensor() as m:
        chunked_mlp(x, *params, "swiglu", num_chunks=chunks).sum().backward()
    # largest: one chunk's fc1 output [s/chunks, b, 2*ffn] (or a weight), never [s, b, ffn]
    assert m.numel <= max(s // chunks * b * 2 * ffn, 2 * ffn * h, s * b * h)
    assert m.numel < s * b * ffn


def _loss_case(s, b, h, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(s, b, h, generator=g, dtype=torch.float64) + torch.arange(s)[:, None, None] / s).to(dtype)
    w = (torch.randn(V, h, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (b, s), generator=g)
    dloss = torch.rand(b, s, generator=g, dtype=torch.float64).to(dtype)
    return hid, w, labels, dloss


def _loss_grads(fn, hid, w, labels, dloss):
    hid = hid.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    loss = fn(hid, w, labels)
    loss.backward(dloss.to(loss.dtype))
    return loss.detach(), hid.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_loss_matches_unchunked(dtype):
    for chunks, b in ((1, 1), (2, 2), (4, 2), (8, 3)):
        hid, w, labels, dloss = _loss_case(16, b, 8, 40, dtype, seed=chunks)
        ref = _loss_grads(reference_cross_entropy, hid, w, labels, dloss)
        got = _loss_grads(lambda h_, w_, l_: chunked_cross_entropy(h_, w_, l_, num_chunks=chunks), hid, w, labels, dloss)
        assert got[0].shape == (b, 16)  # [b, s], the loss-mask layout, for any micro-batch
        for a, r in zip(got, ref):
            assert _err(a, r) <= TOL[dtype], (chunks, b)


def test_chunked_loss_with_mask_is_megatron_mean():
    hid, w, labels, _ = _loss_case(16, 2, 8, 40, torch.float64, seed=1)
    mask = torch.ones(2, 16, dtype=torch.float64)
    mask[0, :5] = 0
    mask[1, 10:] = 0
    per_token = chunked_cross_entropy(hid, w, labels, num_chunks=4)
    expected = torch.nn.functional.cross_entropy((hid @ w.t()).permute(1, 0, 2).reshape(-1, 40), labels.reshape(-1), reduction="none")
    assert torch.allclose((per_token * mask).sum() / mask.sum(), (expected * mask.reshape(-1)).sum() / mask.sum(), atol=1e-12)


def test_chunked_loss_never_holds_full_logits():
    s, b, h, V, chunks = 64, 2, 8, 512, 8
    hid, w, labels, _ = _loss_case(s, b, h, V, torch.float32, seed=3)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    with LargestTensor() as m:
        chunked_cross_entropy(hid, w, labels, num_chunks=chunks).sum().backward()
    assert m.numel == s // chunks * b * V  # one chunk's logits is the largest tensor


def _tp_run(rank, world):
    """Vocab-parallel loss and TP MLP at TP=2 vs the unsharded single-rank references."""
    tp = dist.group.WORLD
    out = {}
    for dtype in (torch.float64, torch.float32):
        for chunks, b in ((1, 1), (4, 2)):
            hid, w, labels, dloss = _loss_case(16, b, 8, 40, dtype, seed=10 + chunks)
            ref = _loss_grads(reference_cross_entropy, hid, w, labels, dloss)
            V_l = 40 // world
            w_local = w[rank * V_l : (rank + 1) * V_l]
            got = _loss_grads(lambda h_, w_, l_: chunked_cross_entropy(h_, w_, l_, chunks, tp), hid, w_local, labels, dloss)
            errs = [_err(got[0], ref[0]), _err(got[1], ref[1]), _err(got[2], ref[2][rank * V_l : (rank + 1) * V_l])]
            out[("loss", dtype, chunks, b)] = max(errs)
        # TP MLP: fc1 rows [gate_shard | up_shard], fc2 columns
        s, h, ffn = 16, 8, 16
        params = _mlp_params(h, ffn, True, True, dtype, seed=5)
        x = torch.randn(s, 2, h, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
        dy = torch.ones_like(x)
        ref = _mlp_grads(lambda x_, *p: reference_mlp(x_, *p, "swiglu"), x, params, dy)
        f = ffn // world
        w1, b1, w2, b2 = (p.detach() for p in params)
        rows = torch.cat([torch.arange(rank * f, (rank + 1) * f), ffn + torch.arange(rank * f, (rank + 1) * f)])
        local = [w1[rows].clone().requires_grad_(True), b1[rows].clone().requires_grad_(True),
                 w2[:, rank * f : (rank + 1) * f].clone().requires_grad_(True), b2.clone().requires_grad_(True)]
        got = _mlp_grads(lambda x_, *p: chunked_mlp(x_, *p, "swiglu", 4, tp), x, local, dy)
        errs = [_err(got[0], ref[0]), _err(got[1], ref[1]), _err(got[2], ref[2][rows]), _err(got[3], ref[3][rows]),
                _err(got[4], ref[4][:, rank * f : (rank + 1) * f]), _err(got[5], ref[5])]
        out[("mlp", dtype)] = max(errs)
    return out


def test_vocab_parallel_loss_and_tp_mlp_at_tp2():
    for rank, res in enumerate(run_distributed(_tp_run, 2, timeout=180)):
        for key, err in res.items():
            dtype = key[1]
            assert err <= TOL[dtype], f"rank {rank} {key}: {err:.2e}"


def test_bad_arguments_raise_one_line():
    hid, w, labels, _ = _loss_case(16, 2, 8, 40, torch.float32, seed=0)
    for call in (
        lambda: chunked_cross_entropy(hid, w, labels, num_chunks=3),
        lambda: chunked_cross_entropy(hid, w, labels.t(), num_chunks=2),
        lambda: chunked_mlp(hid, *_mlp_params(8, 8, True, False, torch.float32, 0), "swiglu", num_chunks=5),
        lambda: chunked_mlp(hid, *_mlp_params(8, 8, False, False, torch.float32, 0), "swiglu", num_chunks=2),
        lambda: chunked_mlp(hid, *_mlp_params(8, 8, False, False, torch.float32, 0), "tanh", num_chunks=2),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert "\n" not in str(e.value)
