"""The run's console lines: every rank computes them, rank 0 prints them (Megatron's print_rank_0)."""

from __future__ import annotations

import torch.distributed as dist


def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)
