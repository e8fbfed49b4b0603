"""FPDT token layout: which global tokens each context-parallel rank holds.

The sequence of S tokens is cut into u*P pieces of L = S/(u*P) tokens (C/P, with C = S/u
the chunk length). Rank r holds pieces r, P+r, 2P+r, ... in that order, so its local
chunk j is global piece j*P+r; after the per-chunk all-to-all every rank holds the
contiguous global block [jC, (j+1)C). With u = 1 this is plain contiguous sharding
(rank r holds [rS/P, (r+1)S/P)), i.e. Ulysses. Tokens, labels, loss mask and position
ids of a [b, S] batch all follow the same permutation.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from megatron_weipipe.fpdt.config import check_layout


def local_token_indices(seq_len: int, cp_size: int, cp_rank: int, num_chunks: int, device=None) -> torch.Tensor:
    """Global positions of rank ``cp_rank``'s local tokens, in local order ([S/P] int64)."""
    check_layout(seq_len, cp_size, num_chunks)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp_size})")
    piece = seq_len // (num_chunks * cp_size)
    starts = (torch.arange(num_chunks, device=device) * cp_size + cp_rank) * piece
    return (starts[:, None] + torch.arange(piece, device=device)[None, :]).reshape(-1)


def global_order(seq_len: int, cp_size: int, num_chunks: int, device=None) -> torch.Tensor:
    """Global positions of the concatenation rank 0's shard, rank 1's shard, ... ([S])."""
    return torch.cat(
        [local_token_indices(seq_len, cp_size, r, num_chunks, device) for r in range(cp_size)]
    )


def shard(x: torch.Tensor, cp_size: int, cp_rank: int, num_chunks: int, dim: int = 1) -> torch.Tensor:
    """This rank's local shard of a full tensor along its sequence dimension ``dim``."""
    idx = local_token_indices(x.shape[dim], cp_size, cp_rank, num_chunks, x.device)
    return x.index_select(dim, idx)


def unshard(shards: list[torch.Tensor], num_chunks: int, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from every rank's shard (rank order)."""
    cp_size = len(shards)
    cat = torch.cat(shards, dim=dim)
    order = global_order(cat.shape[dim], cp_size, num_chunks, cat.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return cat.index_select(dim, inverse)


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def shard_batch(
    batch: Mapping[str, torch.Tensor | None], cp_size: int, cp_rank: int, num_chunks: int
) -> dict[str, torch.Tensor | None]:
    """Shard a Megatron GPT batch ([b, S] tensors) for one context-parallel rank.

    tokens, labels, loss_mask and position_ids are permuted along dim 1; other entries
    (e.g. attention_mask, which must be None for causal FPDT) are passed through.
    """
    out: dict[str, torch.Tensor | None] = {}
    for key, value in batch.items():
        if key in BATCH_KEYS and value is not None:
            out[key] = shard(value, cp_size, cp_rank, num_chunks, dim=1)
        else:
            out[key] = value
    return out


def gather_sequence(x_local: torch.Tensor, group, num_chunks: int, dim: int = 1) -> torch.Tensor:
    """All-gather local shards over the CP group and undo the permutation (e.g. per-token
    losses [b, S/P] -> [b, S] for logging or evaluation). Not autograd-aware."""
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return unshard(parts, num_chunks, dim=dim)
