"""Deferred weight gradients: the zero-bubble split of a backward into I and W.

In the input step (BACKWARD_INPUT) a linear layer computes only its input gradient and
hands the store what its weight gradient needs; the weight step (BACKWARD_WEIGHT) runs
only those weight GEMMs and adds them into the chunk's gradient token. Everything
without a deferrable weight (attention core, activations, norms with their weights,
biases) is done in the input step.

The store is made by the runtime for one iteration (no global state) and must be
empty when the iteration ends. What it keeps (inputs and output gradients of the
deferred GEMMs) is counted: `held_bytes` now, `peak_bytes` over the iteration.

A pending item only has to say which parameter it belongs to, how many bytes it keeps
and how to produce its gradient (`DeferredGrad`), so another kernel (e.g. Transformer
Engine's delayed wgrad, `backward_dw()`) can sit behind the same interface; only the
local GEMM (`GemmGrad`) is implemented and checked here.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist


class DeferredGrad(Protocol):
    name: str  # the parameter's name in the chunk template (its slot in the flat layout)

    def nbytes(self) -> int: ...

    def compute(self) -> torch.Tensor: ...  # the weight gradient, shaped as the parameter


@dataclass
class GemmGrad:
    """dW = dY^T X of one linear layer (leading dimensions flattened)."""

    name: str
    x: torch.Tensor
    dy: torch.Tensor

    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size() + self.dy.numel() * self.dy.element_size()

    def compute(self) -> torch.Tensor:
        dy = self.dy.reshape(-1, self.dy.size(-1))
        x = self.x.reshape(-1, self.x.size(-1))
        return dy.t().matmul(x)


class WeightGradStore:
    """Pending weight gradients of one iteration, keyed by (microbatch, chunk)."""

    def __init__(self):
        self._pending: dict[Hashable, list[DeferredGrad]] = {}
        self.held_bytes = 0
        self.peak_bytes = 0
        self.deferred = 0  # items recorded over the iteration

    def add(self, key: Hashable, item: DeferredGrad) -> None:
        self._pending.setdefault(key, []).append(item)
        self.held_bytes += item.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.deferred += 1

    def names(self, key: Hashable) -> set[str]:
        return {item.name for item in self._pending.get(key, ())}

    def flush(self, key: Hashable, add: Callable[[str, torch.Tensor], None]) -> int:
        """Run the weight GEMMs of `key`, hand each result to `add(name, grad)`, forget
        them (their activations are freed here). Returns how many ran."""
        items = self._pending.pop(key, [])
        for item in items:
            add(item.name, item.compute())
            self.held_bytes -= item.nbytes()
        return len(items)

    def check_empty(self, where: str) -> None:
        if self._pending:
            raise RuntimeError(f"{where}: weight gradients still pending for {sorted(self._pending)}")


@dataclass(frozen=True)
class _Scope:
    store: WeightGradStore
    key: Hashable


# The scope a forward records into: set by the runtime around the forwards whose
# backward is split, read by the layers. It points at the iteration's store; it holds none.
_SCOPE: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar("weipipe_wgrad_scope", default=None)


@contextlib.contextmanager
def deferring(store: WeightGradStore, key: Hashable) -> Iterator[None]:
    """Linear layers run inside this block defer their weight gradients to `store[key]`."""
    token = _SCOPE.set(_Scope(store, key))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def active() -> bool:
    """Whether a linear layer called now should defer (a scope is open, autograd on)."""
    return _SCOPE.get() is not None and torch.is_grad_enabled()


class _DeferredLinear(torch.autograd.Function):
    """Y = X W^T (+ b). Backward: dX (all-reduced over `tp_group` when asked, as the
    column-parallel layer's input gradient is) and db now; dW deferred to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, scope, name, allreduce_dgrad, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.scope, ctx.name, ctx.use_bias = scope, name, bias is not None
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(dx, group=ctx.tp_group, async_op=True)
        db = dy.reshape(-1, dy.size(-1)).sum(dim=0) if ctx.use_bias else None
        ctx.scope.store.add(ctx.scope.key, GemmGrad(ctx.name, x.detach(), dy.detach()))
        if handle is not None:
            handle.wait()
        return dx, None, db, None, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], name: str, *,
                    allreduce_dgrad: bool = False, tp_group=None) -> torch.Tensor:
    """A linear layer whose weight gradient goes to the open scope's store (call only
    when `active()`). `name` is the weight's name in the chunk template."""
    scope = _SCOPE.get()
    if scope is None:
        raise RuntimeError("deferred_linear called outside a deferring() scope")
    return _DeferredLinear.apply(x, weight, bias, scope, name, allreduce_dgrad, tp_group)
