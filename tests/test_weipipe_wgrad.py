"""Deferred weight gradients (schedules/runtime/wgrad.py): the input step gives the
input and bias gradients and no weight gradient; the weight step's GEMM gives exactly
autograd's weight gradient; the store counts what it keeps and refuses to end non-empty."""

from __future__ import annotations

import pytest
import torch

from megatron_weipipe.schedules.runtime.wgrad import WeightGradStore, active, deferred_linear, deferring


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    w = torch.randn(6, 8, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    dy = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)
    return x, w, b, dy


def test_input_step_defers_the_weight_gemm_and_weight_step_matches_autograd():
    x, w, b, dy = _data()
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*ref).backward(dy)

    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    store = WeightGradStore()
    assert not active()
    with deferring(store, (0, 1)):
        assert active()
        y = deferred_linear(xs, ws, bs, "fc.weight")
    assert not active()
    y.backward(dy)
    assert ws.grad is None  # no weight GEMM in the input step
    torch.testing.assert_close(xs.grad, ref[0].grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(bs.grad, ref[2].grad, rtol=0, atol=1e-12)
    assert store.names((0, 1)) == {"fc.weight"} and store.deferred == 1
    kept = x.numel() * 8 + dy.numel() * 8  # input and output gradient, float64
    assert store.held_bytes == kept and store.peak_bytes == kept
    with pytest.raises(RuntimeError, match="still pending"):
        store.check_empty("end of iteration")
    got = {}
    assert store.flush((0, 1), lambda name, g: got.setdefault(name, g)) == 1
    torch.testing.assert_close(got["fc.weight"], ref[1].grad, rtol=0, atol=1e-12)
    assert store.held_bytes == 0 and store.peak_bytes == kept
    store.check_empty("end of iteration")


def test_deferred_linear_needs_a_scope_and_no_grad_runs_nothing():
    x, w, b, _ = _data()
    with pytest.raises(RuntimeError, match="outside a deferring"):
        deferred_linear(x, w, b, "w")
    store = WeightGradStore()
    with deferring(store, 0), torch.no_grad():
        assert not active()  # the layers then take their ordinary path
