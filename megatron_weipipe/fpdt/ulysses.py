"""Ulysses all-to-all between sequence sharding and head sharding.

Layout is Megatron's [s, b, h, ...]: ``seq_to_heads`` turns this rank's [s/P, b, h, ...]
into [s, b, h/P, ...] (tokens of all ranks, rank-ordered, for this rank's contiguous
slice of heads); ``heads_to_seq`` is its inverse. Each is the other's backward, so the
autograd wrappers just swap them. The group is always passed in; None or size 1 is the
identity. Works on any backend with all_to_all_single (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

HEAD_DIM = 2  # [s, b, h, ...]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class CommCounter:
    """Bytes this rank sends through all-to-all (a count, for tests and benchmarks)."""

    calls: int = 0
    bytes_sent: int = 0

    def add(self, t: torch.Tensor, world: int) -> None:
        self.calls += 1
        self.bytes_sent += t.numel() * t.element_size() * (world - 1) // world


class Pending:
    """An all-to-all in flight; ``wait()`` returns the rearranged result."""

    def __init__(self, work, buf: torch.Tensor, finish):
        self._work, self._buf, self._finish = work, buf, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish(self._buf)


def _done(x: torch.Tensor) -> Pending:
    return Pending(None, x, lambda t: t)


def seq_to_heads_async(x: torch.Tensor, group, counter: CommCounter | None = None) -> Pending:
    """[s/P, b, h, *rest] -> [s, b, h/P, *rest] (launch; call .wait())."""
    world = group_size(group)
    if world == 1:
        return _done(x)
    s_local, b, h = x.shape[:3]
    rest = x.shape[3:]
    if h % world:
        raise ValueError(f"head dimension {h} is not divisible by the context-parallel size {world}")
    # Slab r of the send buffer holds the heads that rank r will own.
    send = x.reshape(s_local, b, world, h // world, *rest).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    if counter is not None:
        counter.add(send, world)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    # Received slab r holds rank r's tokens: rank order is sequence order.
    return Pending(work, recv, lambda t: t.reshape(world * s_local, b, h // world, *rest))


def heads_to_seq_async(x: torch.Tensor, group, counter: CommCounter | None = None) -> Pending:
    """[s, b, h/P, *rest] -> [s/P, b, h, *rest] (launch; call .wait())."""
    world = group_size(group)
    if world == 1:
        return _done(x)
    s, b, hp = x.shape[:3]
    rest = x.shape[3:]
    if s % world:
        raise ValueError(f"sequence dimension {s} is not divisible by the context-parallel size {world}")
    send = x.contiguous()  # slab r (along s) goes to rank r
    recv = torch.empty_like(send)
    if counter is not None:
        counter.add(send, world)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish(t: torch.Tensor) -> torch.Tensor:
        # Received slab r holds my tokens for rank r's heads: heads go back in rank order.
        return t.reshape(world, s // world, b, hp, *rest).movedim(0, 2).reshape(s // world, b, world * hp, *rest)

    return Pending(work, recv, finish)


def spread_kv(mixed: torch.Tensor, replicas: int, head_dim: int) -> torch.Tensor:
    """[s, b, groups, (g+2)d] -> [s, b, groups*R, (g/R+2)d]: slab r*R+i holds query heads
    [i*g/R, (i+1)*g/R) of group r and the group's k, v (autograd: its backward is gather_kv)."""
    if replicas == 1:
        return mixed
    s, b, ng, w = mixed.shape
    g = w // head_dim - 2
    q, kv = mixed.split([g * head_dim, 2 * head_dim], dim=-1)
    q = q.reshape(s, b, ng, replicas, g // replicas * head_dim)
    kv = kv.unsqueeze(3).expand(s, b, ng, replicas, 2 * head_dim)
    return torch.cat([q, kv], dim=-1).reshape(s, b, ng * replicas, (g // replicas + 2) * head_dim)


def gather_kv(grad: torch.Tensor, replicas: int, head_dim: int) -> torch.Tensor:
    """Adjoint of spread_kv: [s, b, groups*R, (g/R+2)d] -> [s, b, groups, (g+2)d], the R
    replicas' k and v gradients summed onto the group."""
    if replicas == 1:
        return grad
    s, b, n, w = grad.shape
    qw = w - 2 * head_dim
    grad = grad.reshape(s, b, n // replicas, replicas, w)
    q = grad[..., :qw].reshape(s, b, n // replicas, replicas * qw)
    return torch.cat([q, grad[..., qw:].sum(dim=3)], dim=-1)


def seq_to_heads(x: torch.Tensor, group, counter: CommCounter | None = None) -> torch.Tensor:
    return seq_to_heads_async(x, group, counter).wait()


def heads_to_seq(x: torch.Tensor, group, counter: CommCounter | None = None) -> torch.Tensor:
    return heads_to_seq_async(x, group, counter).wait()


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return seq_to_heads(x, group, counter)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.group, ctx.counter), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return heads_to_seq(x, group, counter)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.group, ctx.counter), None, None


def all_to_all_seq_to_heads(x: torch.Tensor, group, counter: CommCounter | None = None) -> torch.Tensor:
    """Autograd-aware [s/P, b, h, ...] -> [s, b, h/P, ...]; backward is the inverse all-to-all."""
    if group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, group, counter)


def all_to_all_heads_to_seq(x: torch.Tensor, group, counter: CommCounter | None = None) -> torch.Tensor:
    """Autograd-aware [s, b, h/P, ...] -> [s/P, b, h, ...]; backward is the inverse all-to-all."""
    if group_size(group) == 1:
        return x
    return _HeadsToSeq.apply(x, group, counter)
