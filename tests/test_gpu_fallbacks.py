"""Unverified GPU paths fall back to local layers with a one-line notice (model/layer_choice.py),
decided for a faked CUDA + Transformer Engine host: the Platform is passed in and nothing
touches CUDA."""

from __future__ import annotations

import logging

import pytest

from harness.runs import tiny_gpt_args
from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.model import layer_choice
from megatron_weipipe.model.layer_choice import DROPOUT_REPLAY_TE, WEIPIPE_TE, choose_layers
from megatron_weipipe.platform import Platform
from megatron_weipipe.schedules import registry

TE_HOST = Platform("cuda", "nccl", transformer_engine=True)
CUDA_NO_TE = Platform("cuda", "nccl", transformer_engine=False)
CPU = Platform("cpu", "gloo")


def _cfg(world_size=2, **overrides):
    defaults = dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave")
    defaults.update(overrides)
    return parse_config(tiny_gpt_args(**defaults), world_size=world_size)


def test_weipipe_schedules_are_the_weipipe_prefix():
    """layer_choice tells WeiPipe schedules by name (the model layer cannot import the registry)."""
    assert registry.weipipe_names()
    assert {n for n in registry.names() if n.startswith("weipipe")} == set(registry.weipipe_names())


def test_faked_platform_reports_te_without_cuda():
    assert TE_HOST.transformer_engine_available() and TE_HOST.is_cuda
    assert not CUDA_NO_TE.transformer_engine_available()
    assert not Platform("cpu", "gloo", transformer_engine=True).transformer_engine_available()


def test_weipipe_over_te_falls_back_to_local_layers_with_notice(caplog, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_weipipe.model.gpt import layer_spec

    monkeypatch.setattr(layer_choice, "_announced", set())
    cfg = _cfg()
    with caplog.at_level(logging.WARNING, logger=layer_choice.__name__):
        spec = layer_spec(cfg, TE_HOST)  # TE's spec would need transformer_engine installed
        layer_spec(cfg, TE_HOST)
    local = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    assert spec.submodules.self_attention.submodules.linear_qkv == local.submodules.self_attention.submodules.linear_qkv
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # once per process, one line
    assert WEIPIPE_TE in lines[0] and "unverified on GPU" in lines[0] and "--allow-unverified-gpu-paths" in lines[0]
    assert "\n" not in lines[0]


def test_flag_keeps_transformer_engine():
    choice = choose_layers(_cfg(allow_unverified_gpu_paths=True), TE_HOST)
    assert choice.transformer_engine and choice.notices == ()
    explicit = _cfg(allow_unverified_gpu_paths=True, transformer_impl="transformer_engine")
    assert choose_layers(explicit, TE_HOST).transformer_engine


def test_dropout_replay_under_te_is_named():
    cfg = _cfg(hidden_dropout=0.1, recompute_granularity="full", recompute_method="uniform")
    choice = choose_layers(cfg, TE_HOST)
    assert not choice.transformer_engine
    assert [n for n in choice.notices if DROPOUT_REPLAY_TE in n] and [n for n in choice.notices if WEIPIPE_TE in n]
    assert len(choose_layers(_cfg(), TE_HOST).notices) == 1  # no dropout: only the functional_call path


def test_verified_paths_keep_their_layers():
    assert choose_layers(_cfg(pipeline_schedule="1f1b"), TE_HOST) == layer_choice.LayerChoice(True)
    assert choose_layers(_cfg(world_size=1, pipeline_model_parallel_size=1, pipeline_schedule=None),
                         TE_HOST).transformer_engine
    for platform in (CUDA_NO_TE, CPU):
        assert choose_layers(_cfg(), platform) == layer_choice.LayerChoice(False)
    assert choose_layers(_cfg(transformer_impl="local"), TE_HOST) == layer_choice.LayerChoice(False)


def test_explicit_te_without_te_is_refused():
    with pytest.raises(ConfigError, match="needs transformer-engine"):
        choose_layers(_cfg(pipeline_schedule="1f1b", transformer_impl="transformer_engine"), CUDA_NO_TE)
