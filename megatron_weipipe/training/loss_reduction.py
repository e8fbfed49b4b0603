"""The iteration's one host sync: the losses, the NaN/Inf count and the exit flags in one all-reduce.

The per-microbatch losses stay on the device; the one ``.tolist()`` of the reduced vector
is the iteration's host sync (host_values.py). Only after a NaN/Inf was counted does a
second reduction name the first bad microbatch.

Each microbatch reports an "lm loss" that is either its mean (a scalar) or, under
--calculate-per-token-loss, the pair [sum of its token losses, its loss tokens] (Megatron-
LM's loss_func). Both enter the reduction as (sum, count) pairs, a mean as (mean, 1): the
logged loss is the summed sums over the summed counts, i.e. the mean of the microbatch
means, or the global batch's per-token loss, whose count the training step also divides
the gradients by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_weipipe.context import RunContext
from megatron_weipipe.host_values import all_reduce_values
from megatron_weipipe.parallel import ParallelGroups


@dataclass
class ReducedLosses:
    """Sums over every rank: the finite losses and their count (microbatches, or loss tokens
    under --calculate-per-token-loss), the bad losses, the flags."""

    total: float
    count: float
    bad: int
    flags: list[float]

    @property
    def mean(self) -> Optional[float]:
        return self.total / self.count if self.count else None


def loss_values(result) -> list[torch.Tensor]:
    """This rank's per-microbatch lm losses as [sum, count] pairs, where they are (no read-back)."""
    return [_as_pair(d["lm loss"]) for d in result.losses]


def _as_pair(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().reshape(-1)
    return value if value.numel() == 2 else torch.cat([value, torch.ones_like(value)])


def reports_loss(result, groups: ParallelGroups) -> bool:
    """Whether this rank's losses enter the logged loss: one rank per replica that has them."""
    return result.has_loss and groups.tp_rank == 0 and groups.cp_rank == 0


def reduce_losses(
    ctx: RunContext, losses: list[torch.Tensor], contributes: bool, flags: list[float], checks: bool = False
) -> ReducedLosses:
    """One all-reduce: sum and count of the finite losses, bad-loss count, exit flags.

    The logged loss comes from the ``contributes`` ranks (one per replica); NaN/Inf is
    looked for on every rank that ``checks`` (has a loss: each tensor and context rank
    holds its own share of it).
    """
    device = ctx.platform.collective_device()
    stacked = torch.stack([v.to(device=device, dtype=torch.float64) for v in losses]) \
        if losses else torch.zeros(0, 2, dtype=torch.float64, device=device)
    finite = torch.isfinite(stacked[:, 0])
    none = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.where(finite, stacked[:, 0], 0.0).sum() if contributes else none
    count = torch.where(finite, stacked[:, 1], 0.0).sum() if contributes else none
    bad = (~finite).sum(dtype=torch.float64) if checks else none
    reduced = all_reduce_values([total, count, bad, *flags], ctx.platform)
    return ReducedLosses(reduced[0], reduced[1], int(reduced[2]), reduced[3:])


def first_bad_microbatch(ctx: RunContext, losses: list[torch.Tensor], has_loss: bool) -> tuple[int, int]:
    """(global rank, microbatch) of the first NaN/Inf loss anywhere (only after one was seen)."""
    code = 1 << 60
    if has_loss:
        for i, v in enumerate(torch.stack([v[0] for v in losses]).tolist() if losses else []):
            if not math.isfinite(v):
                code = dist.get_rank() * 1_000_000 + i
                break
    (first,) = all_reduce_values([code], ctx.platform, op=dist.ReduceOp.MIN)
    return int(first) // 1_000_000, int(first) % 1_000_000
