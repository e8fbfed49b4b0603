"""The memory estimator against real allocations of tiny megatron-core models on the CPU:
parameter, gradient and optimizer bytes counted on the built model and optimizer, and
activations counted with saved-tensor hooks (unique storages saved for backward)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_weipipe.schedules.generate.megatron_timeline import build
from megatron_weipipe.simulator import memory
from megatron_weipipe.training.host_calibration import pretrain_config_for, single_process_megatron
from megatron_weipipe.simulator.rank_order import Layout
from megatron_weipipe.simulator.run_spec import RunSpec
from megatron_weipipe.shape import ModelShape

GPT = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                 vocab_size=1000)
LLAMA = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=64,
                   micro_batch_size=2, vocab_size=500, swiglu=True, normalization="RMSNorm",
                   add_bias_linear=False, position_embedding_type="rope")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _measure(shape: ModelShape, dropout: float, backend: str = "unfused", recompute: tuple = ()) -> dict:
    from megatron.core.distributed import DistributedDataParallel

    from megatron_weipipe.model.gpt import build_gpt_model
    from megatron_weipipe.schedules.gpt.megatron_schedules import ddp_config
    from megatron_weipipe.training.optimizer import build_optimizer

    cfg = pretrain_config_for(shape, shape.num_layers)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = dropout
    cfg.model.attention_backend = backend  # unfused: megatron-core's s x s path; flash: torch's fused kernel
    if recompute:  # selective recomputation: a norm's freed output counts 0 bytes once the layer has run
        cfg.model.recompute_granularity, cfg.model.recompute_modules = "selective", list(recompute)
    with single_process_megatron(cfg):
        model = build_gpt_model(cfg, shape.padded_vocab(), pre_process=True, post_process=True)
        params = list(model.parameters())
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config(cfg), module=model)
        optimizer = build_optimizer(cfg, [ddp])
        for p in params:
            p.main_grad.normal_()
        optimizer.step()
        state = [v for s in optimizer.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        out = {"params": sum(p.numel() for p in params), "param_bytes": _storage_bytes(params),
               "grad_bytes": _storage_bytes(p.main_grad for p in params), "optimizer_bytes": _storage_bytes(state)}
        # activations of the decoder layers for one microbatch
        rope = model.rotary_pos_emb(shape.seq_length) if shape.position_embedding_type == "rope" else None
        x = torch.randn(shape.seq_length, shape.micro_batch_size, shape.hidden_size, requires_grad=True)
        weights = {p.untyped_storage().data_ptr() for p in params}
        saved = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x
            for layer in model.decoder.layers:
                h, _ = layer(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
        out["activation_bytes"] = _storage_bytes(saved)
    return out


@pytest.fixture(scope="module")
def measured():
    out = {(name, d): _measure(shape, d) for name, shape in (("gpt", GPT), ("llama", LLAMA)) for d in (0.0, 0.1)}
    out.update({(name, "flash"): _measure(shape, 0.0, "flash") for name, shape in (("gpt", GPT), ("llama", LLAMA))})
    out.update({(name, m): _measure(shape, 0.1, recompute=(m,)) for name, shape in (("gpt", GPT), ("llama", LLAMA))
                for m in SELECTIVE})
    return out


@pytest.mark.parametrize("name,shape", [("gpt", GPT), ("llama", LLAMA)])
def test_model_state_bytes_match_the_built_model_and_optimizer(measured, name, shape):
    m = measured[(name, 0.0)]
    spec = RunSpec(shape, Layout(), global_batch_size=2, schedule="none", compute_bytes=4).validate()
    assert spec.rank_params(0) == m["params"]
    state = memory.state_bytes_for(4)  # fp32 on the CPU: weights are the master, Adam's two moments
    assert m["param_bytes"] == m["params"] * state.param
    assert m["grad_bytes"] == m["params"] * state.grad
    assert m["optimizer_bytes"] == m["params"] * state.optimizer
    est = spec.rank_params(0) * state.per_param()
    real = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
    assert est == pytest.approx(real, rel=0.10)


@pytest.mark.parametrize("name,shape", [("gpt", GPT), ("llama", LLAMA)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_bytes_within_ten_percent(measured, name, shape, dropout):
    opts = memory.ActivationOptions(impl="unfused", dtype_bytes=4, dropout=dropout > 0)
    est = shape.num_layers * memory.layer_activation_bytes(shape, opts)
    assert est == pytest.approx(measured[(name, dropout)]["activation_bytes"], rel=0.10)


@pytest.mark.parametrize("name,shape", [("gpt", GPT), ("llama", LLAMA)])
def test_activation_bytes_with_the_fused_cpu_attention_within_ten_percent(measured, name, shape):
    """--attention-backend flash (the CPU default): local layers with torch's fused core."""
    opts = memory.ActivationOptions(impl="unfused", dtype_bytes=4, dropout=False, flash_attention=True)
    est = shape.num_layers * memory.layer_activation_bytes(shape, opts)
    assert est == pytest.approx(measured[(name, "flash")]["activation_bytes"], rel=0.10)
    assert measured[(name, "flash")]["activation_bytes"] < measured[(name, 0.0)]["activation_bytes"]


SELECTIVE = ("core_attn", "mlp", "layernorm")


@pytest.mark.parametrize("name,shape", [("gpt", GPT), ("llama", LLAMA)])
@pytest.mark.parametrize("module", SELECTIVE)
def test_selective_recompute_activation_bytes_within_ten_percent(measured, name, shape, module):
    """--recompute-modules: what a layer still saves (the estimator within 0.6% of the measured bytes),
    and what it drops (within 1.1% of the measured drop)."""
    opts = memory.ActivationOptions(impl="unfused", dtype_bytes=4, dropout=True, recompute=(module,))
    est = shape.num_layers * memory.layer_activation_bytes(shape, opts)
    got, plain = measured[(name, module)]["activation_bytes"], measured[(name, 0.1)]["activation_bytes"]
    assert est == pytest.approx(got, rel=0.10)
    drop = shape.num_layers * memory.recomputed_bytes(shape, opts)
    assert drop == pytest.approx(plain - got, rel=0.10) and got < plain


@pytest.mark.parametrize("P,N", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_in_flight_microbatches(P, N):
    assert memory.peak_in_flight(build("1f1b", P, 1, N=N)) == tuple(min(P - r, N) for r in range(P))


def test_weipipe_ranks_hold_the_same_and_a_split_backward_frees_at_w_or_at_i():
    for name in ("weipipe-interleave", "weipipe-zb"):
        peaks = memory.peak_in_flight(build(name, 4, 2))
        assert len(set(peaks)) == 1 and 1 <= peaks[0] <= 8
    zb = build("weipipe-zb", 4, 2)
    assert memory.peak_in_flight(zb, freed_at_input=True) <= memory.peak_in_flight(zb)
    assert memory.peak_in_flight(zb, freed_at_input=True) == memory.peak_in_flight(build("weipipe-interleave", 4, 2))
    bufs = memory.peak_buffers(build("weipipe-interleave", 4, 2))
    assert all(b.weights >= 2 and b.grads >= 1 for b in bufs)


def test_recomputation_keeps_only_inputs():
    shape = dataclasses.replace(GPT, num_layers=8)
    full = RunSpec(shape, Layout(pp=4), 16, "1f1b", compute_bytes=4, attention_impl="unfused").validate()
    re = dataclasses.replace(full, recompute=True)
    from megatron_weipipe.simulator.project import rank_memory

    sched = full.build_schedule()
    a, b = rank_memory(full, sched, None), rank_memory(re, sched, None)
    assert all(y.activations < x.activations for x, y in zip(a, b))
    assert b[0].activations == pytest.approx(4 * 2 * memory.layer_input_bytes(shape, memory.ActivationOptions(
        impl="unfused", dtype_bytes=4)))
