"""Layout-invariant initialisation: every parameter drawn from fixed tiles of its global tensor.

megatron-core initialises weights in the order ranks build them, so the same seed gives a
different model at PP=2 than at PP=1. Here every global tensor (a sharded-checkpoint key,
plus the layer index for stacked layers) is cut into tiles of a fixed shape that no parallel
layout changes (``tile_shape``), and each tile is drawn from its own generator, seeded by
(seed, key, layer, tile index). A rank draws only the tiles that overlap its shard, on the
parameter's device, into one tile-sized buffer that it copies into the local tensor: the
work is proportional to the shard and no full-size copy exists. The model is the same under
every TP / PP / VPP / WeiPipe / FSDP layout (FSDP shards the initialised TP-local tensors).

Values depend on the device kind: the CPU draws with torch's mt19937 (which keeps 32 bits of
each seed), a GPU with its philox generator (all 64 bits). A CPU run and a GPU run at equal
seed therefore start from different draws of the same distribution; on one kind of host all
ranks and layouts agree. A tile has 32768 elements: CUDA draws it with one grid of 128 blocks,
below every GPU's cap (SMs x blocks per SM), so its values do not depend on the GPU model
either (unverified on GPU).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

# Tile extent along dim 0 (never clipped: the vocabulary dim is padded per TP size, and the
# tiles of the real rows must not move with it) and along the last dim (clipped to its size,
# which no layout changes). Column-parallel shards (dim 0) are multiples of 128 rows and
# row-parallel shards (dim 1) of 256 columns for the usual shapes, so shards cut no tile.
TILE_ROWS = 128
TILE_COLS = 256

# The TransformerConfig fields through which megatron-core draws its initial weights.
_CORE_INIT_FIELDS = ("init_method", "output_layer_init_method", "embedding_init_method")


@dataclass
class InitStats:
    """What one reinitialisation did (its cost, for tests and measurements)."""

    tensors: int = 0
    tiles: int = 0
    elements_drawn: int = 0  # generator outputs, whole tiles
    elements_filled: int = 0  # local elements written (normal, ones and zeros)


def init_kind(key: str) -> str:
    """How megatron-core initialises the tensor behind a sharded-state-dict key. A decoder
    layer's norms are saved under Transformer Engine's fused names (``input_layernorm.weight``
    as ``linear_qkv.layer_norm_weight``): their weights are ones as well."""
    leaf = key.rsplit(".", 1)[-1]
    if "layernorm" in key or "layer_norm" in key or key.endswith("norm.weight"):
        return "ones" if leaf.endswith("weight") else "zeros"
    if leaf == "bias":
        return "zeros"
    if "linear_proj" in key or "linear_fc2" in key:
        return "scaled_normal"
    return "normal"


def tile_shape(global_shape: Sequence[int]) -> tuple[int, ...]:
    """The fixed tile of a global tensor of this shape (its layer axes removed)."""
    k = len(global_shape)
    if k == 0:
        return ()
    if k == 1:
        return (TILE_ROWS * TILE_COLS,)
    return (TILE_ROWS,) + (1,) * (k - 2) + (min(int(global_shape[-1]), TILE_COLS),)


def tile_seed(seed: int, key: str, layer_coords: tuple, tile: tuple) -> int:
    digest = hashlib.sha256(f"{seed}:{key}@{tuple(layer_coords)}#{tuple(tile)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tiles_overlapping(global_shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> Iterator[tuple]:
    """Indices of the tiles that a box (offset, size) of the global tensor touches."""
    extent = tile_shape(global_shape)
    if any(n == 0 for n in size):
        return iter(())
    ranges = [range(o // e, (o + n - 1) // e + 1) for o, n, e in zip(offset, size, extent)]
    return itertools.product(*ranges)


@torch.no_grad()
def draw_shard(local: torch.Tensor, *, seed: int, key: str, layer_coords: tuple, global_shape: Sequence[int],
               global_offset: Sequence[int], std: float, stats: Optional[InitStats] = None) -> None:
    """Fill ``local``, the box of the global tensor at ``global_offset``, with N(0, std) values:
    those of the global tensor's tiles, each drawn whole in float32 on ``local``'s device."""
    stats = stats if stats is not None else InitStats()
    extent = tile_shape(global_shape)
    if not len(local.shape) == len(global_offset) == len(global_shape):
        raise ValueError(f"{key}: local shape {tuple(local.shape)} does not match global {tuple(global_shape)}")
    tile_numel = math.prod(extent)
    buf = torch.empty(extent, dtype=torch.float32, device=local.device)
    gen = torch.Generator(device=local.device)
    for tile in tiles_overlapping(global_shape, global_offset, local.shape):
        gen.manual_seed(tile_seed(seed, key, layer_coords, tile))
        buf.normal_(0.0, std, generator=gen)
        src, dst = [], []
        for t, e, o, n in zip(tile, extent, global_offset, local.shape):
            lo, hi = max(t * e, o), min((t + 1) * e, o + n)
            src.append(slice(lo - t * e, hi - t * e))
            dst.append(slice(lo - o, hi - o))
        local[tuple(dst)].copy_(buf[tuple(src)])
        stats.tiles += 1
        stats.elements_drawn += tile_numel
    stats.elements_filled += local.numel()


def sharded_leaves(d) -> Iterator:
    """The leaves of a (sharded) state dict: nested dicts, lists and tuples walked in order."""
    if isinstance(d, dict):
        for v in d.values():
            yield from sharded_leaves(v)
    elif isinstance(d, (list, tuple)):
        for v in d:
            yield from sharded_leaves(v)
    else:
        yield d


def _sharded_tensors(model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, list]]:
    """(tensor, its ShardedTensors) for every tensor of the sharded state dict. A
    ShardedTensorFactory (SwiGLU's fc1: gate and up halves saved as two pieces of one key)
    is built into its pieces, views of the parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for entry in sharded_leaves(model.sharded_state_dict()):
        if isinstance(entry, ShardedTensor) and isinstance(entry.data, torch.Tensor):
            yield entry.data, [entry]
        elif isinstance(entry, ShardedTensorFactory) and isinstance(entry.data, torch.Tensor):
            pieces = [p for p in sharded_leaves(entry.build()) if isinstance(p, ShardedTensor)]
            if sum(p.data.numel() for p in pieces) != entry.data.numel():
                raise RuntimeError(f"{entry.key}: the factory's pieces do not cover its tensor")
            yield entry.data, pieces


def _is_placeholder(t: torch.Tensor) -> bool:
    """A fake (tools/dry_run.py) or meta tensor: no values to draw."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


@torch.no_grad()
def reinitialize_layout_invariant(model: torch.nn.Module, seed: int, std: float, num_layers: int,
                                  zero_centered_norms: bool = False) -> InitStats:
    """Draw every floating tensor of ``model``'s sharded state dict from its key's tiles:
    N(0, std), N(0, std / sqrt(2 * num_layers)) for the output projections (linear_proj,
    linear_fc2), ones and zeros for norms and biases, as megatron-core does (norm weights
    zeros too when ``zero_centered_norms``: applied as 1 + weight). Raises if a
    parameter has no entry: megatron-core's own initialisation was skipped
    (``core_initialization_skipped``), so it would keep uninitialised memory."""
    scaled_std = std / math.sqrt(2.0 * num_layers)
    stats = InitStats()
    done = set()
    for data, pieces in _sharded_tensors(model):
        if id(data) in done or not data.is_floating_point():
            continue
        done.add(id(data))
        stats.tensors += 1
        if _is_placeholder(data):
            continue
        for sh in pieces:
            if sh.flattened_range is not None:
                raise RuntimeError(f"{sh.key}: flattened shards are not model tensors")
            kind = init_kind(sh.key)
            if kind in ("ones", "zeros"):
                sh.data.fill_(1.0 if kind == "ones" and not zero_centered_norms else 0.0)
                stats.elements_filled += sh.data.numel()
                continue
            n = sh.prepend_axis_num  # stacked layers: the layer index leads as "prepended" axes
            shape = tuple(sh.global_shape[n:])
            local = sh.data.view(tuple(sh.local_shape[len(sh.local_shape) - len(shape):]))
            draw_shard(local, seed=seed, key=sh.key, layer_coords=tuple(sh.global_offset[:n]), global_shape=shape,
                       global_offset=tuple(sh.global_offset[n:]),
                       std=scaled_std if kind == "scaled_normal" else std, stats=stats)
    missing = [name for name, p in model.named_parameters() if id(p) not in done]
    if missing:
        raise RuntimeError("layout-invariant init: no sharded-state-dict entry for " + ", ".join(missing)
                           + " (they would stay uninitialised); use --no-layout-invariant-init")
    return stats


def _leave_uninitialised(tensor: torch.Tensor) -> torch.Tensor:
    return tensor  # megatron-core assigns what some init methods return (softmax_offset)


@contextlib.contextmanager
def core_initialization_skipped(config, enabled: bool = True):
    """Build under this to skip megatron-core's random draws that the layout-invariant init
    overwrites (``enabled``). Its init methods are swapped for one that leaves the tensor as
    allocated, and restored on exit. ``perform_initialization`` stays on: megatron-core (0.16)
    sets the tensor-parallel attributes of its linear and embedding weights
    (``tensor_model_parallel``, which the gradient norm reads) only while initialising them.
    On a CPU host (``use_cpu_initialization``) megatron-core still allocates each weight's
    full master tensor, left untouched (copied only for the local shard, cast first under
    --bf16); on a GPU it allocates the local shard only."""
    if not enabled:
        yield config
        return
    saved = {name: getattr(config, name) for name in _CORE_INIT_FIELDS}
    for name in _CORE_INIT_FIELDS:
        setattr(config, name, _leave_uninitialised)
    try:
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
