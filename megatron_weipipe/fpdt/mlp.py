"""MLP run chunk by chunk along the sequence, recomputing the wide intermediate in backward.

Weights are Megatron's: linear_fc1 [ffn(*2 if gated), hidden] whose output for gated
activations is [gate | up] concatenated (megatron.core.transformer.mlp's glu chunks the
output in two and computes act(first) * second), linear_fc2 [hidden, ffn]. With a TP group
they are the local shards and the output is summed over the group.

Only one chunk's [c, b, ffn] intermediate exists at a time, forward or backward. The
saved input is never written to: the input gradient is a fresh tensor, so a norm that
saved the same tensor still backprops (the public implementation wrote its gradient into
the saved input in place, DeepSpeed issue #7706).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from megatron_weipipe.fpdt.kernels import acc_dtype, accumulate_matmul
from megatron_weipipe.fpdt.tp import all_reduce_
from megatron_weipipe.fpdt.ulysses import group_size


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _squared_relu(x):
    return torch.square(F.relu(x))


# name -> (elementwise activation, gated)
ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (_gelu_tanh, False),
    "relu": (F.relu, False),
    "squared_relu": (_squared_relu, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
}


def _activate(h: torch.Tensor, act: Callable, gated: bool) -> torch.Tensor:
    if gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        return act(gate) * up
    return act(h)


@dataclass
class _MLPPlan:
    act: Callable
    gated: bool
    num_chunks: int
    tp_group: Any


def _bounds(n: int, chunks: int):
    step = n // chunks
    return [(c * step, (c + 1) * step) for c in range(chunks)]


class ChunkedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan: _MLPPlan):
        s, b, _ = x.shape
        out = torch.empty(s, b, w2.shape[0], dtype=x.dtype, device=x.device)
        for lo, hi in _bounds(s, plan.num_chunks):
            a = _activate(F.linear(x[lo:hi], w1, b1), plan.act, plan.gated)
            torch.matmul(a, w2.t(), out=out[lo:hi])
            del a
        all_reduce_(out, plan.tp_group)
        if b2 is not None:
            out += b2
        ctx.plan = plan
        ctx.save_for_backward(x, w1, b1, w2, b2)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w1, b1, w2, b2 = ctx.saved_tensors
        plan = ctx.plan
        acc = acc_dtype(dy.dtype)
        dy = dy.contiguous()
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        dx = torch.empty_like(x) if need_x else None
        dw1 = db1 = dw2 = None
        for lo, hi in _bounds(x.shape[0], plan.num_chunks):
            xc, dyc = x[lo:hi], dy[lo:hi]
            with torch.enable_grad():
                h = F.linear(xc, w1, b1).detach().requires_grad_(True)
                a = _activate(h, plan.act, plan.gated)
            if need_w2:
                dw2 = accumulate_matmul(dw2, dyc.flatten(0, 1).t(), a.detach().flatten(0, 1))
            (dh,) = torch.autograd.grad(a, h, torch.matmul(dyc, w2))
            del a, h
            if need_w1:
                dw1 = accumulate_matmul(dw1, dh.flatten(0, 1).t(), xc.flatten(0, 1))
            if b1 is not None and need_b1:
                g = dh.sum(dim=(0, 1))
                db1 = g.to(acc) if db1 is None else db1 + g
            if need_x:
                torch.matmul(dh, w1, out=dx[lo:hi])
            del dh
        if dx is not None:
            all_reduce_(dx, plan.tp_group)
        db2 = dy.sum(dim=(0, 1)) if (b2 is not None and need_b2) else None

        def cast(t, like):
            return None if (t is None or like is None) else t.to(like.dtype)

        return dx, cast(dw1, w1), cast(db1, b1), cast(dw2, w2), cast(db2, b2), None


def chunked_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    activation: str = "swiglu",
    num_chunks: int = 1,
    tp_group=None,
) -> torch.Tensor:
    """MLP of x [s, b, hidden] in ``num_chunks`` sequence chunks; returns [s, b, hidden]
    summed over ``tp_group``, with ``fc2_bias`` added when given."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
    act, gated = ACTIVATIONS[activation]
    if x.dim() != 3:
        raise ValueError(f"MLP input must be [s, b, hidden], got shape {tuple(x.shape)}")
    if num_chunks <= 0 or x.shape[0] % num_chunks:
        raise ValueError(f"num_chunks={num_chunks} must divide the local sequence length {x.shape[0]}")
    ffn = fc2_weight.shape[1]
    if fc1_weight.shape != (ffn * (2 if gated else 1), x.shape[-1]):
        raise ValueError(
            f"linear_fc1 weight {tuple(fc1_weight.shape)} does not fit activation {activation!r} with "
            f"linear_fc2 weight {tuple(fc2_weight.shape)} and hidden size {x.shape[-1]}"
        )
    plan = _MLPPlan(act, gated, num_chunks, tp_group if group_size(tp_group) > 1 else None)
    return ChunkedMLPFunction.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, plan)


def reference_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation: str = "swiglu"):
    """Unchunked single-rank MLP with Megatron's layout, through plain autograd."""
    act, gated = ACTIVATIONS[activation]
    out = F.linear(_activate(F.linear(x, fc1_weight, fc1_bias), act, gated), fc2_weight)
    return out + fc2_bias if fc2_bias is not None else out
