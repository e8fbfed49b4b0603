"""Tensor-parallel reductions over an explicitly passed group (Megatron's
reduce_from / copy_to tensor-model-parallel region, without its globals)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_weipipe.fpdt.ulysses import group_size


def all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.clone(), ctx.group), None


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over TP (row-parallel output); backward is the identity."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity into a column-parallel layer; backward sums the input gradient over TP."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)
