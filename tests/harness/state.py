"""Gather parameters or gradients of any parallel layout into full, layout-free tensors.

Each rank reports its shards under their checkpoint keys (key, layer coordinates and
offsets, taken from the sharded state dict); ``assemble`` stitches them together in the
test process. Two runs under different schedules can then be compared tensor by tensor.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from megatron_weipipe.model.init import sharded_leaves

Shard = tuple[tuple[int, ...], tuple[int, ...], np.ndarray]  # (global shape, offsets, data)


def _grad_of(param: torch.Tensor):
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def local_shards(model_chunks: Iterable[torch.nn.Module], what: str = "param") -> dict[str, list[Shard]]:
    """This rank's shards of every model tensor, keyed by '<key>@<layer coords>'."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_weipipe.training.checkpoint.torch_dist_format import unwrap

    out: dict[str, list[Shard]] = {}
    for chunk in map(unwrap, model_chunks):
        params = {p.data_ptr(): p for p in chunk.parameters()}
        for sh in sharded_leaves(chunk.sharded_state_dict()):
            if not isinstance(sh, ShardedTensor) or not isinstance(sh.data, torch.Tensor):
                continue
            if not sh.data.is_floating_point():
                continue
            tensor = sh.data
            if what == "grad":
                p = params.get(sh.data.data_ptr())
                if p is None or p.numel() != sh.data.numel():
                    continue
                g = _grad_of(p)
                if g is None:
                    continue
                tensor = g
            n = sh.prepend_axis_num
            name = f"{sh.key}@{tuple(sh.global_offset[:n])}"
            shape = tuple(sh.global_shape[n:])
            offsets = tuple(sh.global_offset[n:])
            out.setdefault(name, []).append(
                (shape, offsets, tensor.detach().float().cpu().reshape(sh.local_shape[-len(shape):] if shape else ()).numpy().copy())
            )
    return out


def assemble(per_rank: Iterable[dict[str, list[Shard]]]) -> dict[str, np.ndarray]:
    """Full tensors from every rank's shards (replicas must agree; the first one wins)."""
    full: dict[str, np.ndarray] = {}
    for shards in per_rank:
        for name, pieces in shards.items():
            for shape, offsets, data in pieces:
                if name not in full:
                    full[name] = np.full(shape, np.nan, dtype=np.float64)
                index = tuple(slice(o, o + s) for o, s in zip(offsets, data.shape))
                target = full[name][index]
                if np.isnan(target).all():
                    full[name][index] = data
    return full


def max_relative_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str]:
    """Largest ||a-b|| / ||b|| over tensors present in both; raises if key sets differ."""
    if set(a) != set(b):
        raise AssertionError(f"different tensors: only in first {sorted(set(a) - set(b))[:5]}, "
                             f"only in second {sorted(set(b) - set(a))[:5]}")
    worst, where = 0.0, ""
    for k in a:
        if np.isnan(a[k]).any() or np.isnan(b[k]).any():
            raise AssertionError(f"{k} has missing (NaN) entries")
        denom = max(np.linalg.norm(b[k]), 1e-30)
        rel = float(np.linalg.norm(a[k] - b[k]) / denom)
        if rel > worst:
            worst, where = rel, k
    return worst, where
