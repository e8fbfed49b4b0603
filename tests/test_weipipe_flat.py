"""Flat chunk layout: one contiguous vector per chunk, modules see views into it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from megatron_weipipe.schedules.runtime.flat import FlatViews


def _chunk(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))


def test_views_share_storage_and_gradients_land_in_the_flat_vector():
    m = _chunk(0)
    layout = FlatViews.from_module(m)
    assert layout.numel == sum(p.numel() for p in m.parameters())
    flat = layout.flatten(m).requires_grad_()
    x = torch.randn(3, 4)
    y = functional_call(m, layout.views(flat), (x,))
    torch.testing.assert_close(y, m(x), rtol=0, atol=0)
    y.sum().backward()
    m(x).sum().backward()
    torch.testing.assert_close(flat.grad, torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    views = layout.views(flat.detach())
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views.values())


def test_load_into_round_trips_and_bad_shapes_are_refused():
    a, b = _chunk(0), _chunk(1)
    layout = FlatViews.from_module(a)
    layout.load_into(b, layout.flatten(a))
    torch.testing.assert_close(layout.flatten(b), layout.flatten(a))
    with pytest.raises(ValueError, match="layout needs"):
        layout.views(torch.zeros(layout.numel + 1))
    with pytest.raises(ValueError, match="missing"):
        layout.flatten({"0.weight": torch.zeros(4)})
    with pytest.raises(ValueError, match="no parameters"):
        FlatViews.from_module(nn.Tanh())
