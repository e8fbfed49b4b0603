"""--offload-layer-inputs: bitwise the run without it, and the restore really reads the host copy.

Each run pair trains 3 float32 steps with full recomputation, once keeping the layer
inputs on the device and once on the host; losses, gradient norms, every gradient and
every parameter must be equal bit for bit (plain attention, FPDT with its own chunk
offload, Ulysses CP=2, megatron-core's 1F1B at P=2 and weipipe-interleave at P=2). The
counted copies show the inputs went to the host. Separately, a saved input corrupted on
the device after the forward must not change the gradients with offload (and does
without, so the check can fail), and the store's restored tensor is a copy of the host
buffer, not the device tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import run_distributed
from harness.runs import tiny_gpt_args, train_and_collect
from harness.state import assemble

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError
from megatron_weipipe.platform import Platform

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform")
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
             seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4)

WORLD1 = {
    "plain": dict(RECOMPUTE),
    "plain-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "fpdt-offload": dict(LLAMA, fpdt=True, fpdt_chunk_size=16, fpdt_offload=True, **RECOMPUTE),
}
WORLD2 = {
    "1f1b-pp2": dict(RECOMPUTE, pipeline_model_parallel_size=2),
    "weipipe-interleave-ring2": dict(RECOMPUTE, pipeline_model_parallel_size=2,
                                     pipeline_schedule="weipipe-interleave"),
    "ulysses-cp2": dict(LLAMA, context_parallel_size=2, **RECOMPUTE),
}


def _train_pairs(rank, world_size, configs, check_hooks=False):
    """Each configuration without and with --offload-layer-inputs, and what the stores copied."""
    from megatron_weipipe.model import layer_offload

    stores = []
    init = layer_offload.LayerInputStore.__init__

    def recording_init(self, *a, **k):
        init(self, *a, **k)
        stores.append(self)

    layer_offload.LayerInputStore.__init__ = recording_init
    out = []
    for flags in configs:
        plain = train_and_collect(rank, world_size, tiny_gpt_args(**flags))
        stores.clear()
        offloaded = train_and_collect(rank, world_size, tiny_gpt_args(**flags, offload_layer_inputs=True))
        offloaded["copied"] = {
            "d2h": sum(s.stats.d2h_bytes for s in stores), "h2d": sum(s.stats.h2d_bytes for s in stores),
            "most_resident": max((max(s.stats.max_resident.values(), default=0) for s in stores), default=0),
            "host_buffers": sum(s.pool.allocations for s in stores),
        }
        out.append((plain, offloaded))
    layer_offload.LayerInputStore.__init__ = init
    if check_hooks:
        out.append(_corrupted_input_gradients())
    return out


def _corrupted_input_gradients():
    """Gradients of a 3-unit stack recomputed by megatron-core's CheckpointFunction, with each
    saved input overwritten on the device after the forward (behind autograd's back)."""
    from megatron.core import tensor_parallel

    from megatron_weipipe.model.layer_offload import LayerInputStore, install_on_block
    from megatron_weipipe.platform import detect_platform

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.corrupt = False

        def _checkpointed_forward(self, hidden_states):
            h = hidden_states
            for lin in self.lins:
                x = h
                h = tensor_parallel.checkpoint(lambda t, lin=lin: torch.tanh(lin(t)), False, h)
                if self.corrupt:
                    x.data.add_(100.0)
            return h

    def grads(offload, corrupt):
        stack = Stack()
        store = None
        if offload:
            store = LayerInputStore(detect_platform())
            install_on_block(stack, store)
        stack.corrupt = corrupt
        inp = torch.linspace(-1, 1, 32).reshape(4, 8).requires_grad_(True)
        stack._checkpointed_forward(inp * 1.0).square().sum().backward()
        stats = None if store is None else (store.stats.fetches, dict(store.stats.max_resident))
        return [inp.grad.clone()] + [p.grad.clone() for p in stack.parameters()], stats

    clean, _ = grads(False, False)
    kept, _ = grads(False, True)
    offloaded, stats = grads(True, True)
    return {"clean": clean, "corrupt_kept": kept, "corrupt_offloaded": offloaded, "stats": stats}


def _merged(per_rank, i, which):
    runs = [r[i][which] for r in per_rank]
    return {
        "losses": runs[0]["losses"], "grad_norms": runs[0]["grad_norms"],
        "grads": {it: assemble(r["grads"][it] for r in runs) for it in runs[0]["grads"]},
        "params": assemble(r["params"] for r in runs),
        "copied": [r.get("copied") for r in runs],
    }


@pytest.fixture(scope="module")
def world1():
    per_rank = run_distributed(_train_pairs, 1, list(WORLD1.values()), True, timeout=600)
    pairs = {name: (_merged(per_rank, i, 0), _merged(per_rank, i, 1)) for i, name in enumerate(WORLD1)}
    return pairs, per_rank[0][-1]


@pytest.fixture(scope="module")
def world2():
    per_rank = run_distributed(_train_pairs, 2, list(WORLD2.values()), timeout=600)
    return {name: (_merged(per_rank, i, 0), _merged(per_rank, i, 1)) for i, name in enumerate(WORLD2)}


def _assert_bitwise(plain, offloaded):
    assert offloaded["losses"] == plain["losses"] and len(plain["losses"]) == 3
    assert offloaded["grad_norms"] == plain["grad_norms"]
    for it, ref in plain["grads"].items():
        for key, g in ref.items():
            assert np.array_equal(offloaded["grads"][it][key], g), f"iteration {it}: gradient of {key} differs"
    for key, p in plain["params"].items():
        assert np.array_equal(offloaded["params"][key], p), f"parameter {key} differs"
    for copied in offloaded["copied"]:
        assert copied["d2h"] > 0 and copied["h2d"] == copied["d2h"], copied  # every input back exactly once
        assert copied["most_resident"] <= 2, copied


@pytest.mark.parametrize("layout", list(WORLD1))
def test_bitwise_single_rank(layout, world1):
    _assert_bitwise(*world1[0][layout])


@pytest.mark.parametrize("layout", list(WORLD2))
def test_bitwise_two_ranks(layout, world2):
    _assert_bitwise(*world2[layout])


def test_host_buffers_are_reused(world1):
    """4 layers, 4 microbatches one after the other, 3 steps: 48 inputs through 4 buffers."""
    copied = world1[0]["plain"][1]["copied"][0]
    layer_input = 32 * 2 * 32 * 4  # s x b x h x fp32
    assert copied["d2h"] == 48 * layer_input and copied["host_buffers"] == 4, copied


def test_gradients_come_from_the_host_copy(world1):
    hooks = world1[1]
    for a, b in zip(hooks["corrupt_offloaded"], hooks["clean"]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(hooks["corrupt_kept"], hooks["clean"]))
    fetches, resident = hooks["stats"]
    assert fetches == 3 and resident == {"layer_input": 1}  # taken, then the next one prefetched


def test_store_restores_a_separate_copy_of_the_host_buffer():
    from megatron_weipipe.model.layer_offload import STREAM, LayerInputStore

    store = LayerInputStore(Platform("cpu", "gloo"))
    x = torch.arange(12.0).reshape(3, 4)
    store.put("a", x)
    x.add_(1000.0)  # the device tensor after the forward: not what comes back
    host = store.store._held[(STREAM, "a")]["x"]
    assert torch.equal(host, torch.arange(12.0).reshape(3, 4))
    host[0, 0] = -7.0  # the restore reads the host buffer
    back = store.take("a")
    assert back[0, 0].item() == -7.0 and back.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    with pytest.raises(KeyError):
        store.take("a")
    store.put("b", x)
    assert store.pool.allocations == 1  # the buffer of "a" again


def test_flag_rules_are_one_line():
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args(offload_layer_inputs=True))
    assert str(e.value).startswith("--offload-layer-inputs needs --recompute-granularity full")
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args(cpu_offloading=True, **RECOMPUTE))
    msg = str(e.value)
    assert msg.startswith("--cpu-offloading is not supported here") and "--offload-layer-inputs" in msg
    assert "\n" not in msg
