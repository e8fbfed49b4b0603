"""The layer's norms in sequence chunks (fpdt/chunked.py): same values and gradients as
the whole-sequence norm, and only the input kept for backward."""

from __future__ import annotations

import torch

from megatron_weipipe.fpdt.chunked import sequence_chunked, sequence_chunked_module


def _saved_bytes(fn):
    """Bytes autograd keeps for backward while fn runs (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_chunked_rmsnorm_matches_and_keeps_only_its_input():
    torch.manual_seed(0)
    s, b, h = 96, 2, 64
    norm = torch.nn.RMSNorm(h, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not ones: the weight gradient must matter
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, b, h, dtype=torch.bfloat16)

    whole, whole_saved = _saved_bytes(lambda: norm(x))
    gx_whole, gw_whole = torch.autograd.grad(whole, (x, norm.weight), grad)
    chunked, chunked_saved = _saved_bytes(lambda: sequence_chunked(norm.forward, x, 4))
    gx, gw = torch.autograd.grad(chunked, (x, norm.weight), grad)

    assert torch.equal(chunked, whole)  # token-wise: the cut changes nothing
    assert torch.equal(gx, gx_whole)
    # the weight gradient sums bf16 partial sums per chunk: compare both with a float64 norm
    ref_norm = torch.nn.RMSNorm(h, eps=1e-5).double()
    with torch.no_grad():
        ref_norm.weight.copy_(norm.weight.double())
    (gw_ref,) = torch.autograd.grad(ref_norm(x.detach().double()), (ref_norm.weight,), grad.double())
    err = lambda g: ((g.double() - gw_ref).norm() / gw_ref.norm()).item()  # noqa: E731
    assert err(gw) < 1e-2 and err(gw_whole) < 1e-2, (err(gw), err(gw_whole))
    # the whole-sequence norm keeps float32 copies (2 x 2 x the input); chunks keep the input views
    assert whole_saved >= 4 * x.numel() * x.element_size()
    assert chunked_saved <= x.numel() * x.element_size() + 4096


def test_chunked_weight_gradient_float64_exact_order_free():
    torch.manual_seed(1)
    norm = torch.nn.RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(40, 3, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    ref = torch.autograd.grad(norm(x), (x, norm.weight), g)
    got = torch.autograd.grad(sequence_chunked(norm.forward, x, 7), (x, norm.weight), g)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_spec_entry_builds_the_same_module_with_chunked_forward():
    build = sequence_chunked_module(torch.nn.LayerNorm, 3)
    module = build(8)
    assert type(module) is torch.nn.LayerNorm and set(module.state_dict()) == {"weight", "bias"}
    x = torch.randn(9, 2, 8)
    torch.testing.assert_close(module(x), torch.nn.functional.layer_norm(x, (8,), module.weight, module.bias))
    with torch.no_grad():  # no gradients: chunks, no checkpoint
        torch.testing.assert_close(module(x), torch.nn.functional.layer_norm(x, (8,), module.weight, module.bias))
