"""Layout-invariant initialisation draws only this rank's shard, and the model stays the same
under every layout (megatron_weipipe/model/init.py).

GPU defect guarded: start-up of an 8B-70B model drew every full global tensor in float32 on
the CPU of every rank (minutes, tens of GB of host memory per rank, 8 ranks per node), after
megatron-core had drawn its own weights that were then thrown away. The tiled draw must keep
the model identical under TP / PP splits (the parity tests start every layout from it), must
cost in proportion to the shard, and must keep megatron-core's tensor-parallel attributes
(the gradient norm of a TP > 1 run reads them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import run_distributed
from harness.runs import tiny_gpt_args
from megatron_weipipe.model.init import sharded_leaves

# Shapes whose TP=2 shards cut no tile (column shards: multiples of 128 rows, row shards: of
# 256 columns): 4 layers, hidden 512, FFN 1024, SwiGLU (fc1 saved as gate and up halves),
# untied output layer, no biases, rotary positions (no learned position table).
MODEL = dict(num_layers=4, hidden_size=512, num_attention_heads=4, ffn_hidden_size=1024, seq_length=32,
             make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True)
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}


# ---- the tiling itself, without a model -------------------------------------------------


def _draw(global_shape, offset, size, key="w", coords=(), std=0.02, stats=None):
    from megatron_weipipe.model.init import draw_shard

    local = torch.empty(size)
    draw_shard(local, seed=1234, key=key, layer_coords=coords, global_shape=global_shape,
               global_offset=offset, std=std, stats=stats)
    return local


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n, parts + 1).astype(int)
    return [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("shape, dim", [((768, 512), 0), ((512, 1024), 1), ((1000, 300), 0), ((1000, 300), 1),
                                        ((3000,), 0), ((4, 200, 300), 1), ((), None)])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_tp_shards_reassemble_the_unsharded_tensor(shape, dim, parts):
    """TP=1 and TP=2/3/4 shardings (even and uneven, cutting tiles or not) are pieces of one
    global tensor: the parity tests compare layouts that start from it."""
    full = _draw(shape, (0,) * len(shape), shape)
    if dim is None:
        assert torch.equal(full, _draw(shape, (), ()))
        return
    pieces = []
    for offset, size in _split(shape[dim], parts):
        off = [0] * len(shape)
        off[dim] = offset
        sz = list(shape)
        sz[dim] = size
        pieces.append(_draw(shape, tuple(off), tuple(sz)))
    assert torch.equal(torch.cat(pieces, dim=dim), full)
    assert full.std().item() == pytest.approx(0.02, rel=0.1)


def test_keys_layers_and_padding():
    """Each (key, layer) is its own tensor; a vocabulary padded further (another TP size) keeps
    the values of the real rows."""
    a = _draw((512, 64), (0, 0), (512, 64), key="emb")
    padded = _draw((768, 64), (0, 0), (768, 64), key="emb")
    assert torch.equal(padded[:512], a)
    assert not torch.equal(_draw((512, 64), (0, 0), (512, 64), key="emb", coords=(1,)), a)
    assert not torch.equal(_draw((512, 64), (0, 0), (512, 64), key="other"), a)


class _AllocationTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor storage created while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func._schema.name in ("aten::empty", "aten::empty_strided"):
            self.largest = max(self.largest, out.untyped_storage().nbytes())
        return out


def test_a_shard_draws_in_proportion_to_its_size():
    """A TP=2 shard draws half the elements of the full tensor (whole tiles, none wasted when
    the shard cuts no tile; at most two tile rows more when it does), through one tile-sized
    buffer: no full-size copy."""
    from megatron_weipipe.model.init import TILE_COLS, TILE_ROWS, InitStats, draw_shard

    for shape, dim in (((1536, 512), 0), ((512, 1024), 1)):
        full, half = InitStats(), InitStats()
        _draw(shape, (0, 0), shape, stats=full)
        size = list(shape)
        size[dim] //= 2
        off = [0, 0]
        off[dim] = size[dim]
        local = torch.empty(size, dtype=torch.bfloat16)
        with _AllocationTracker() as alloc:
            draw_shard(local, seed=1234, key="w", layer_coords=(), global_shape=shape, global_offset=tuple(off),
                       std=0.02, stats=half)
        assert full.elements_drawn == shape[0] * shape[1]
        assert half.elements_drawn == full.elements_drawn // 2 == half.elements_filled
        assert alloc.largest == TILE_ROWS * TILE_COLS * 4  # one float32 tile
        index = tuple(slice(o, o + n) for o, n in zip(off, size))
        assert torch.equal(local, _draw(shape, (0, 0), shape)[index].to(torch.bfloat16))
    cut = InitStats()
    _draw((1536, 512), (100, 0), (700, 512), stats=cut)  # cuts two tiles
    assert 700 * 512 < cut.elements_drawn <= (700 + 2 * TILE_ROWS) * 512


def test_uncovered_parameter_is_an_error():
    """megatron-core's own draws are skipped, so a parameter the sharded state dict does not
    name would keep uninitialised memory: refused."""
    from megatron_weipipe.model.init import reinitialize_layout_invariant

    class Stray(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 4))

        def sharded_state_dict(self):
            return {}

    with pytest.raises(RuntimeError, match="no sharded-state-dict entry for w"):
        reinitialize_layout_invariant(Stray(), 1234, 0.02, 2)


# ---- the real model under TP=1, TP=2 and PP=2 ---------------------------------------------


def _shards(model) -> dict:
    """'<key>@<layer>' -> [(global shape, offsets, values)], SwiGLU's fc1 halves included
    (harness.state.local_shards skips factories)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for entry in sharded_leaves(model.sharded_state_dict()):
        pieces = list(sharded_leaves(entry.build())) if isinstance(entry, ShardedTensorFactory) else [entry]
        for sh in pieces:
            if not isinstance(sh, ShardedTensor) or not sh.data.is_floating_point():
                continue
            n = sh.prepend_axis_num
            name = f"{sh.key}@{tuple(sh.global_offset[:n])}"
            shape = tuple(sh.global_shape[n:])
            data = sh.data.detach().float().reshape(tuple(sh.local_shape)[len(sh.local_shape) - len(shape):])
            out.setdefault(name, []).append((shape, tuple(sh.global_offset[n:]), data.numpy().copy()))
    return out


def _assemble(per_rank) -> dict:
    full = {}
    for shards in per_rank:
        for name, pieces in shards.items():
            for shape, offsets, data in pieces:
                target = full.setdefault(name, np.full(shape, np.nan))
                target[tuple(slice(o, o + s) for o, s in zip(offsets, data.shape))] = data
    return full


class _DrawCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Elements produced by random-number ops while active."""

    RANDOM = {"aten::normal_", "aten::normal", "aten::uniform_", "aten::randn", "aten::rand", "aten::random_"}

    def __init__(self):
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.RANDOM:
            self.drawn += (out if isinstance(out, torch.Tensor) else args[0]).numel()
        return out


def _build(rank, world_size, overrides_list):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.initialize import destroy_model_parallel_groups, initialize_distributed
    from megatron_weipipe.model.gpt import build_gpt_model

    tp_layers = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
                 tensor_parallel.VocabParallelEmbedding)
    results = []
    for overrides in overrides_list:
        cfg = parse_config(tiny_gpt_args(**MODEL, **overrides), world_size=world_size)
        ctx = initialize_distributed(cfg)
        pp, pp_rank = ctx.groups.pp_size, ctx.groups.pp_rank
        with _DrawCounter() as counter:
            model = build_gpt_model(cfg, 256, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
        weights = [m.weight for m in model.modules() if isinstance(m, tp_layers)]
        results.append({
            "shards": _shards(model),
            "drawn": counter.drawn,
            "weight_elements": sum(p.numel() for p in model.parameters() if p.dim() >= 2),
            "tp_attributes": all(getattr(w, "tensor_model_parallel", False) for w in weights) and bool(weights),
            "counted_in_norm": all(param_is_not_tensor_parallel_duplicate(w) for w in weights),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        })
        del model
        destroy_model_parallel_groups()
    return results


@pytest.fixture(scope="module")
def reference():
    """The TP=1 single-process model, and the same model initialised by megatron-core."""
    return run_distributed(_build, 1, [{}, {"no_layout_invariant_init": True}], timeout=300)[0]


@pytest.fixture(scope="module")
def layouts():
    per_rank = run_distributed(_build, 2, list(LAYOUTS.values()), timeout=420)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(LAYOUTS)}


def test_single_process_build_draws_each_weight_once(reference):
    """Building draws each weight element once (old: megatron-core's draw, thrown away, then the
    full tensor again), and megatron-core's tensor-parallel attributes are set although its
    draws were skipped."""
    ours, _ = reference
    assert ours["drawn"] == ours["weight_elements"]
    assert ours["tp_attributes"] and ours["finite"]


def test_values_follow_megatron_cores_initialisation(reference):
    """Against megatron-core's own initialisation of the same model (--no-layout-invariant-init):
    the same constants (norm weights one, including a layer's norms saved under Transformer
    Engine's fused names, which used to be drawn as zeros), the same standard deviation
    (scaled for linear_proj / linear_fc2), mean zero."""
    ours, core = (_assemble([r["shards"]]) for r in reference)
    assert sorted(ours) == sorted(core)
    for name, expected in core.items():
        got = ours[name]
        if np.all(expected == expected.flat[0]):
            np.testing.assert_array_equal(got, expected, err_msg=name)
        else:
            assert got.std() == pytest.approx(expected.std(), rel=0.05), name
            assert abs(got.mean()) < 0.05 * expected.std(), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_builds_the_single_process_model(layout, layouts, reference):
    """TP=2 and PP=2 ranks together hold exactly the TP=1 single-process model (SwiGLU's fc1
    included), each rank drawing only its own elements (TP=2: about half), and at TP=2 every
    sharded weight still counts in the gradient norm on both ranks."""
    ranks = layouts[layout]
    full, ref = _assemble([r["shards"] for r in ranks]), _assemble([reference[0]["shards"]])
    assert sorted(full) == sorted(ref)
    for name, values in ref.items():
        np.testing.assert_array_equal(full[name], values, err_msg=name)
    for r in ranks:
        assert r["drawn"] == r["weight_elements"]
        assert r["tp_attributes"] and r["counted_in_norm"] and r["finite"]
    if layout == "tp2":
        assert ranks[0]["drawn"] <= 0.51 * reference[0]["drawn"]
