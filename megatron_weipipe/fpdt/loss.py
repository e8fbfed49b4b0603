"""Output layer + cross-entropy in sequence chunks: [s, V] logits are never materialised.

At S/P = 512K local tokens and V = 128K the logits alone would be 256 GiB in fp32; here only
one chunk's [c, b, V/TP] logits exist at a time, in the forward and again (recomputed) in
the backward. Only the per-token log-sum-exp [s, b] is kept between them.

Vocab-parallel when a TP group of size > 1 is passed: each rank holds rows
[rank*V/TP, (rank+1)*V/TP) of the output weight (Megatron's VocabUtility split), and the
max, the sum of exponentials and the target logit are reduced over the group here.

The per-token loss comes back as [b, s], the layout of labels and loss_mask, for any
micro-batch size (the public implementation returned [s, b]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_weipipe.fpdt.kernels import acc_dtype, accumulate_matmul
from megatron_weipipe.fpdt.tp import all_reduce_
from megatron_weipipe.fpdt.ulysses import group_rank, group_size


@dataclass
class _LossPlan:
    num_chunks: int
    tp_group: Any
    vocab_start: int


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[c, b, hidden] -> fp32 (fp64 for fp64) logits [c, b, V_local]."""
    return torch.matmul(h, w.t()).to(acc_dtype(h.dtype))


def _local_target(labels_sb: torch.Tensor, start: int, vocab_local: int):
    local = labels_sb - start
    inside = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), inside


class ChunkedCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, plan: _LossPlan):
        s, b, _ = hidden.shape
        V_l = weight.shape[0]
        acc = acc_dtype(hidden.dtype)
        step = s // plan.num_chunks
        loss = torch.empty(b, s, dtype=acc, device=hidden.device)
        lse_all = torch.empty(s, b, dtype=acc, device=hidden.device)
        for c in range(plan.num_chunks):
            lo, hi = c * step, (c + 1) * step
            z = _logits(hidden[lo:hi], weight)
            m = z.max(dim=-1).values
            all_reduce_(m, plan.tp_group, dist.ReduceOp.MAX)
            tgt, inside = _local_target(labels[:, lo:hi].t(), plan.vocab_start, V_l)
            stats = torch.stack(
                [torch.exp(z - m.unsqueeze(-1)).sum(-1), z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) * inside]
            )
            all_reduce_(stats, plan.tp_group)  # sum of exp and target logit, one reduction
            lse = m + torch.log(stats[0])
            lse_all[lo:hi] = lse
            loss[:, lo:hi] = (lse - stats[1]).t()
            del z
        ctx.plan = plan
        ctx.save_for_backward(hidden, weight, labels, lse_all)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels, lse_all = ctx.saved_tensors
        plan = ctx.plan
        s = hidden.shape[0]
        V_l = weight.shape[0]
        step = s // plan.num_chunks
        need_h, need_w = ctx.needs_input_grad[:2]
        dh = torch.empty_like(hidden) if need_h else None
        dw = None
        for c in range(plan.num_chunks):
            lo, hi = c * step, (c + 1) * step
            hc = hidden[lo:hi]
            p = torch.exp(_logits(hc, weight) - lse_all[lo:hi].unsqueeze(-1))
            tgt, inside = _local_target(labels[:, lo:hi].t(), plan.vocab_start, V_l)
            p.scatter_add_(-1, tgt.unsqueeze(-1), -inside.to(p.dtype).unsqueeze(-1))
            g = (p * dloss[:, lo:hi].t().to(p.dtype).unsqueeze(-1)).to(hidden.dtype)
            del p
            if need_h:
                torch.matmul(g, weight, out=dh[lo:hi])
            if need_w:
                dw = accumulate_matmul(dw, g.flatten(0, 1).t(), hc.flatten(0, 1))
            del g
        if dh is not None:
            all_reduce_(dh, plan.tp_group)
        return dh, (None if dw is None else dw.to(weight.dtype)), None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int = 1,
    tp_group=None,
) -> torch.Tensor:
    """Per-token loss [b, s] of hidden [s, b, hidden] (after the final norm) against
    labels [b, s], with the output layer weight [V/TP, hidden] (vocab-parallel over
    ``tp_group``). Loss is fp32 (fp64 for fp64 inputs); multiply by loss_mask yourself."""
    if hidden.dim() != 3 or labels.dim() != 2:
        raise ValueError(f"hidden must be [s, b, h] and labels [b, s], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    s, b, _ = hidden.shape
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden [s={s}, b={b}]: expected [b, s]")
    if num_chunks <= 0 or s % num_chunks:
        raise ValueError(f"num_chunks={num_chunks} must divide the local sequence length {s}")
    tp = tp_group if group_size(tp_group) > 1 else None
    plan = _LossPlan(num_chunks, tp, group_rank(tp) * output_weight.shape[0])
    return ChunkedCrossEntropyFunction.apply(hidden, output_weight, labels, plan)


def reference_cross_entropy(hidden: torch.Tensor, output_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Unchunked single-rank per-token loss [b, s] through plain autograd (full logits)."""
    logits = torch.matmul(hidden, output_weight.t()).to(acc_dtype(hidden.dtype))  # [s, b, V]
    return torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
