"""Megatron-LM's --apply-layernorm-1p, --qk-layernorm and --use-cpu-initialization do what they
do there, through megatron-core's TransformerConfig (model/gpt.py, model/norms.py, model/init.py).

--apply-layernorm-1p stores every norm weight zero-centred (applied as 1 + weight): the same
model with its norm weights shifted by -1, so it trains like the plain one; --qk-layernorm adds
megatron-core's per-head query/key norms, whose gradients every schedule sums over TP ranks;
--use-cpu-initialization changes where megatron-core allocates, never the initial values.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness import run_distributed
from harness.runs import merge_ranks, tiny_gpt_args, train_many
from harness.state import max_relative_difference
from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError
from megatron_weipipe.model.init import init_kind
from megatron_weipipe.model.norms import ZeroCenteredNorm

RTOL = 1e-6
TP_RTOL = 5e-6  # see tests/test_foundation_parity.py
# as tests/test_foundation_parity.py: TP-split-independent attention, Adam eps above rounding noise
BASE = dict(make_vocab_size_divisible_by=512, attention_backend="unfused", adam_eps=1e-6)
ONE_P_QK = dict(apply_layernorm_1p=True, qk_layernorm=True, normalization="RMSNorm")


def _argv(**overrides):
    return tiny_gpt_args(**{**BASE, **overrides})


# ---- one norm, no model ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norm_is_the_plain_norm_with_weight_minus_one(kind):
    """At init (0 against 1) the output is bitwise the plain norm's; with a trained weight
    gamma, gamma - 1 gives the same output and the same gradients."""
    torch.manual_seed(0)
    h = 48
    plain = getattr(torch.nn, kind)(h, eps=1e-5)
    shifted = ZeroCenteredNorm(SimpleNamespace(normalization=kind, sequence_parallel=False), h, eps=1e-5)
    assert torch.equal(shifted.weight, torch.zeros(h)) and list(dict(shifted.named_parameters())) == list(
        dict(plain.named_parameters()))
    x = torch.randn(5, 3, h, requires_grad=True)
    assert torch.equal(shifted(x), plain(x))
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        shifted.weight.copy_(plain.weight - 1)
    g = torch.randn(5, 3, h)
    got = torch.autograd.grad(shifted(x), (x, shifted.weight), g)
    want = torch.autograd.grad(plain(x), (x, plain.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- the flags reach megatron-core ----------------------------------------------------------


def test_flags_reach_the_transformer_config():
    from megatron_weipipe.model.gpt import build_transformer_config
    from megatron_weipipe.model.norms import local_layer_spec
    from megatron_weipipe.platform import Platform

    cfg = parse_config(_argv(**ONE_P_QK))
    tconf = build_transformer_config(cfg, platform=Platform("cpu", "gloo"))
    assert tconf.layernorm_zero_centered_gamma and tconf.qk_layernorm and tconf.use_cpu_initialization
    attention = local_layer_spec(cfg).submodules.self_attention.submodules
    assert attention.q_layernorm is ZeroCenteredNorm and attention.k_layernorm is ZeroCenteredNorm
    gpu = Platform("cuda", "nccl", transformer_engine=False)
    assert not build_transformer_config(parse_config(_argv()), platform=gpu).use_cpu_initialization
    assert build_transformer_config(parse_config(_argv(use_cpu_initialization=True)),
                                    platform=gpu).use_cpu_initialization


@pytest.mark.parametrize("layout", [dict(context_parallel_size=2), dict(fpdt=True)])
def test_qk_layernorm_is_refused_where_attention_applies_no_qk_norms(layout):
    with pytest.raises(ConfigError) as err:
        parse_config(_argv(qk_layernorm=True, **layout), world_size=2)
    assert "--qk-layernorm" in str(err.value) and "\n" not in str(err.value)


# ---- built and trained models (one spawn per world size) -------------------------------------


def _shards(rank, world_size, overrides, device_init: bool):
    """Initial parameter shards of one build; ``device_init``: megatron-core allocating on the
    device as on a GPU host (use_cpu_initialization off) instead of the CPU default."""
    from megatron_weipipe.initialize import destroy_model_parallel_groups, initialize_distributed
    from megatron_weipipe.model import gpt
    from harness.state import local_shards

    cfg = parse_config(_argv(**overrides), world_size=world_size)
    initialize_distributed(cfg)
    plain_config = gpt.build_transformer_config

    def device_config(*args, **kwargs):
        tconf = plain_config(*args, **kwargs)
        tconf.use_cpu_initialization = False
        return tconf

    gpt.build_transformer_config = device_config if device_init else plain_config
    try:
        model = gpt.build_gpt_model(cfg, 256, pre_process=True, post_process=True)
    finally:
        gpt.build_transformer_config = plain_config
    shards = local_shards([model])
    destroy_model_parallel_groups()
    return shards


def _world1(rank, world_size):
    builds = {name: _shards(rank, world_size, o, d) for name, (o, d) in {
        "default": ({}, False), "cpu-init-flag": (dict(use_cpu_initialization=True), False),
        "device-init": ({}, True), "1p": (dict(apply_layernorm_1p=True), False)}.items()}
    runs = train_many(rank, world_size, [_argv(), _argv(apply_layernorm_1p=True), _argv(**ONE_P_QK)])
    return builds, runs


@pytest.fixture(scope="module")
def world1():
    from harness.state import assemble

    builds, runs = run_distributed(_world1, 1, timeout=420)[0]
    return {k: assemble([v]) for k, v in builds.items()}, [merge_ranks([runs], i) for i in range(3)]


def _norm_weights(params: dict) -> list[str]:
    return [k for k in params if init_kind(k.split("@")[0]) == "ones"]


def _applied(params: dict) -> dict:
    """Zero-centred parameters as the norms apply them (1 + weight): on the plain model's scale,
    where the relative comparisons of the parity tests hold."""
    norms = _norm_weights(params)
    return {k: v + 1 if k in norms else v for k, v in params.items()}


def test_cpu_initialization_changes_no_initial_value(world1):
    builds, _ = world1
    for name in ("cpu-init-flag", "device-init"):
        assert sorted(builds[name]) == sorted(builds["default"])
        for key, value in builds["default"].items():
            np.testing.assert_array_equal(builds[name][key], value, err_msg=f"{name}: {key}")


def test_1p_initialises_norm_weights_to_zero_and_nothing_else_changes(world1):
    builds, _ = world1
    plain, shifted = builds["default"], builds["1p"]
    norms = _norm_weights(plain)
    assert len(norms) == 2 * 4 + 1  # two per layer and the final norm
    for key, value in plain.items():
        np.testing.assert_array_equal(shifted[key], value - 1 if key in norms else value, err_msg=key)


def test_1p_trains_like_the_plain_model(world1):
    """Same losses and gradients; parameters equal once the norm weights are shifted back."""
    _, (plain, shifted, _) = world1
    np.testing.assert_allclose(shifted["losses"], plain["losses"], rtol=RTOL, atol=0)
    for it, grads in plain["grads"].items():
        rel, where = max_relative_difference(shifted["grads"][it], grads)
        assert rel < RTOL, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(_applied(shifted["params"]), plain["params"])
    assert rel < RTOL, f"parameter {where} differs by {rel:.2e} after 3 steps"


def _world2(rank, world_size):
    """ONE_P_QK at TP=2 (megatron-core's schedules) and in a WeiPipe ring at PP=2 (its runtime
    binds each chunk's circulating weights to the norms)."""
    from harness import weipipe_gpt

    tp2 = train_many(rank, world_size, [_argv(**ONE_P_QK, tensor_model_parallel_size=2,
                                              make_vocab_size_divisible_by=256)])
    ring = weipipe_gpt.train_many(rank, world_size, [_argv(**ONE_P_QK, pipeline_model_parallel_size=2,
                                                           pipeline_schedule="weipipe-zb")])
    return tp2, ring


@pytest.fixture(scope="module")
def world2():
    from harness import weipipe_gpt

    per_rank = run_distributed(_world2, 2, timeout=600)
    return merge_ranks([r[0] for r in per_rank], 0), weipipe_gpt.merge([r[1] for r in per_rank], 0)


@pytest.mark.parametrize("layout", ["tp2", "weipipe-zb-pp2"])
def test_1p_with_qk_norms_matches_one_process(layout, world1, world2):
    """Zero-centred RMSNorms and per-head query/key norms (at TP=2 their gradients summed over
    the ranks, which hold different heads) train as in one process."""
    _, (_, _, reference) = world1
    assert len([k for k in reference["params"] if "q_layernorm" in k or "k_layernorm" in k]) == 2 * 4
    run = world2[0 if layout == "tp2" else 1]
    # TP=2's tolerance is test_foundation_parity's (rounding of the split GEMMs); 1e-5 is the
    # WeiPipe parity tests'
    rtol = TP_RTOL if layout == "tp2" else 1e-5
    for losses in run["loss_sets"]:
        np.testing.assert_allclose(losses, reference["losses"], rtol=rtol, atol=0)
    for it, grads in reference["grads"].items():
        rel, where = max_relative_difference(run["grads"][it], grads)
        assert rel < rtol, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(_applied(run["params"]), _applied(reference["params"]))
    assert rel < rtol, f"parameter {where} differs by {rel:.2e} after 3 steps"


# ---- Hugging Face conversion (tools/checkpoint/hf_llama.py) ----------------------------------

HF = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-6, rope_theta=10000.0,
          tie_word_embeddings=False, max_position_embeddings=64)


def _hf_tensors(shape) -> dict:
    from harness.hf_llama import hf_llama_sizes

    g = torch.Generator().manual_seed(3)
    return {k: (1 + 0.3 * torch.randn(s, generator=g)) if "norm" in k else 0.3 * torch.randn(s, generator=g)
            for k, s in hf_llama_sizes(shape, shape.vocab_size).items()}


def _converted_logits(rank, world_size):
    """Logits of one Hugging Face checkpoint converted plainly and zero-centred."""
    from dataclasses import replace

    from megatron_weipipe.initialize import destroy_model_parallel_groups
    from tools.checkpoint.convert import build_model
    from tools.checkpoint.hf_llama import hf_to_mcore, model_flags, shape_from_hf

    plain = shape_from_hf(HF)
    tokens = torch.randint(0, 255, (1, 16), generator=torch.Generator().manual_seed(5))
    logits = []
    for shape in (plain, replace(plain, zero_centered_norms=True)):
        _, model = build_model(model_flags(shape), shape.vocab_size)
        with torch.no_grad():
            model.load_state_dict(hf_to_mcore(shape, _hf_tensors(shape), shape.vocab_size), strict=True)
            logits.append(model(tokens, torch.arange(16)[None], None).float().numpy())
        destroy_model_parallel_groups()
    return logits


def test_hf_conversion_shifts_the_norm_weights():
    from dataclasses import replace

    from tools.checkpoint.hf_llama import (ConversionError, hf_to_mcore, mcore_to_hf, model_flags, shape_from_flags,
                                           shape_from_hf)

    shape = replace(shape_from_hf(HF), zero_centered_norms=True)
    tensors = _hf_tensors(shape)
    state = hf_to_mcore(shape, tensors, 256)
    assert torch.equal(state["decoder.final_layernorm.weight"], tensors["model.norm.weight"] - 1)
    assert torch.equal(state["decoder.layers.1.pre_mlp_layernorm.weight"],
                       tensors["model.layers.1.post_attention_layernorm.weight"] - 1)
    back = mcore_to_hf(shape, state)
    for k, v in tensors.items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=1e-6)  # (w - 1) + 1: one rounding at most
    flags = model_flags(shape)
    assert "--apply-layernorm-1p" in flags and shape_from_flags(flags, 256) == shape
    with pytest.raises(ConversionError, match="--qk-layernorm") as err:
        shape_from_flags(flags + ["--qk-layernorm"], 256)
    assert "\n" not in str(err.value)


def test_zero_centred_conversion_gives_the_same_logits():
    plain, shifted = run_distributed(_converted_logits, 1, timeout=300)[0]
    np.testing.assert_allclose(shifted, plain, rtol=1e-5, atol=1e-5)
    assert np.abs(plain).max() > 0.1  # not a vanishing output


def test_fpdt_chunked_zero_centred_norm_matches_the_whole_sequence():
    """FPDT builds the layer norms through fpdt/chunked.py: the zero-centred ones chunk alike."""
    from megatron_weipipe.fpdt.chunked import sequence_chunked_module

    torch.manual_seed(2)
    config = SimpleNamespace(normalization="RMSNorm", sequence_parallel=False)
    chunked = sequence_chunked_module(ZeroCenteredNorm, 4)(config, 32, eps=1e-5)
    whole = ZeroCenteredNorm(config, 32, eps=1e-5)
    with torch.no_grad():
        chunked.weight.normal_()
        whole.weight.copy_(chunked.weight)
    x = torch.randn(24, 2, 32, requires_grad=True)
    out = chunked(x)
    assert torch.equal(out, whole(x))
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, chunked.weight), g)
    wx, ww = torch.autograd.grad(whole(x), (x, whole.weight), g)
    assert torch.equal(gx, wx)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)
