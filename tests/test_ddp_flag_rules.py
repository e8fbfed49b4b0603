"""The rules of the data-parallel, pipeline-communication and housekeeping flags (Megatron-LM's,
one line each, before any process group exists), and ``--tp-comm-overlap`` decided for faked
CUDA hosts with and without Transformer Engine: megatron-core's ``tp_comm_overlap`` and TE's
userbuffers on TE layers, one notice and no effect elsewhere."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from harness.runs import tiny_gpt_args

from megatron_weipipe.arguments import OVERLAP_P2P_OFF, parse_config
from megatron_weipipe.config import ConfigError
from megatron_weipipe.platform import Platform

TE_HOST = Platform("cuda", "nccl", transformer_engine=True)
CUDA_NO_TE = Platform("cuda", "nccl", transformer_engine=False)
CPU = Platform("cpu", "gloo")
DIST_OPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)


def _refusal(world_size=2, **flags) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args(**flags), world_size=world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_overlap_param_gather_rules():
    parse_config(tiny_gpt_args(**DIST_OPT, overlap_param_gather=True), world_size=2)
    assert _refusal(overlap_param_gather=True, overlap_grad_reduce=True).startswith(
        "--overlap-param-gather needs --use-distributed-optimizer")
    assert _refusal(overlap_param_gather=True, use_distributed_optimizer=True).startswith(
        "--overlap-param-gather needs --overlap-grad-reduce")
    fsdp = _refusal(overlap_param_gather=True, use_torch_fsdp2=True, untie_embeddings_and_output_weights=True)
    assert fsdp.startswith("--overlap-param-gather cannot be combined with --use-torch-fsdp2") and "prefetches" in fsdp
    weipipe = _refusal(**DIST_OPT, overlap_param_gather=True, pipeline_model_parallel_size=2,
                       pipeline_schedule="weipipe-zb")
    assert weipipe.startswith("--pipeline-schedule weipipe-zb cannot be combined with --overlap-param-gather")


def test_partial_distributed_optimizer_rules():
    cfg = parse_config(tiny_gpt_args(use_distributed_optimizer=True, num_distributed_optimizer_instances=2),
                       world_size=4)
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    assert _refusal(num_distributed_optimizer_instances=2).startswith(
        "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer")
    assert _refusal(world_size=4, use_distributed_optimizer=True, num_distributed_optimizer_instances=3).startswith(
        "--num-distributed-optimizer-instances (3) must divide data x context parallel size (4 x 1)")
    assert _refusal(num_distributed_optimizer_instances=0).startswith(
        "--num-distributed-optimizer-instances must be at least 1")
    assert "--use-torch-fsdp2" in _refusal(num_distributed_optimizer_instances=2)  # HSDP is the other use


def test_the_dry_run_counts_each_instance_holding_its_own_optimizer_state():
    from megatron_weipipe.simulator.project import state_bytes
    from megatron_weipipe.simulator.run_spec import spec_from_config

    def per_param(**flags):
        cfg = parse_config(tiny_gpt_args(use_distributed_optimizer=True, **flags), world_size=4)
        state = state_bytes(spec_from_config(cfg))
        return state.optimizer_shards, state.per_param()

    (shards1, bytes1), (shards2, bytes2) = per_param(), per_param(num_distributed_optimizer_instances=2)
    assert (shards1, shards2) == (4, 2)
    assert bytes2 - bytes1 == pytest.approx(8 / 2 - 8 / 4)  # fp32 Adam moments: 8 bytes a parameter


def test_overlap_p2p_comm_only_with_virtual_stages(caplog):
    interleaved = parse_config(tiny_gpt_args(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                                             overlap_p2p_comm=True), world_size=2)
    assert interleaved.parallel.overlap_p2p_comm
    with caplog.at_level(logging.WARNING):
        plain = parse_config(tiny_gpt_args(pipeline_model_parallel_size=2, overlap_p2p_comm=True), world_size=2)
    assert not plain.parallel.overlap_p2p_comm  # turned off with Megatron-LM's warning
    assert [r.getMessage() for r in caplog.records] == [OVERLAP_P2P_OFF]


def test_housekeeping_flags():
    cfg = parse_config(tiny_gpt_args(manual_gc=True, manual_gc_interval=5, no_manual_gc_eval=True,
                                     empty_unused_memory_level=2))
    t = cfg.training
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval, t.empty_unused_memory_level) == (True, 5, False, 2)
    assert _refusal(manual_gc_interval=-1).startswith("--manual-gc-interval must be non-negative")
    with pytest.raises(SystemExit) as e:
        parse_config(tiny_gpt_args(empty_unused_memory_level=3))
    assert e.value.code == 2


# --------------------------------------------------------------------------- --tp-comm-overlap

TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True, make_vocab_size_divisible_by=64)


def test_tp_comm_overlap_rules():
    assert _refusal(tp_comm_overlap=True).startswith("--tp-comm-overlap needs --sequence-parallel")  # TP 1: SP off
    assert _refusal(tp_comm_overlap=True, tensor_model_parallel_size=2).startswith(
        "--tp-comm-overlap needs --sequence-parallel")
    assert _refusal(tp_comm_overlap=True, deterministic_mode=True, **TP2_SP).startswith(
        "--tp-comm-overlap cannot be combined with --deterministic-mode")


def test_tp_comm_overlap_reaches_transformer_engine_layers_only():
    from megatron_weipipe.model.gpt import build_transformer_config

    cfg = parse_config(tiny_gpt_args(tp_comm_overlap=True, **TP2_SP), world_size=2)
    plain = parse_config(tiny_gpt_args(**TP2_SP), world_size=2)
    assert build_transformer_config(cfg, platform=TE_HOST).tp_comm_overlap
    assert not build_transformer_config(plain, platform=TE_HOST).tp_comm_overlap  # the control
    assert not build_transformer_config(cfg, platform=CUDA_NO_TE).tp_comm_overlap
    assert not build_transformer_config(cfg, platform=CPU).tp_comm_overlap


@pytest.fixture
def fake_te(monkeypatch):
    """A transformer_engine package whose initialize_ub records its arguments (TE 2.7's signature)."""
    calls = []
    base = types.ModuleType("transformer_engine.pytorch.module.base")

    class UserBufferQuantizationMode:
        NONE, FP8 = "none", "fp8"

    def initialize_ub(shape, tp_size, quantization_modes=None, dtype=None, ub_cfgs=None, bootstrap_backend=None):
        calls.append(dict(shape=shape, tp_size=tp_size, quantization_modes=quantization_modes, ub_cfgs=ub_cfgs,
                          bootstrap_backend=bootstrap_backend))

    base.UserBufferQuantizationMode = UserBufferQuantizationMode
    base.initialize_ub = initialize_ub
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    sys.modules["transformer_engine.pytorch.module"].base = base
    return calls


def test_tp_comm_overlap_makes_transformer_engine_userbuffers(fake_te, caplog):
    from megatron_weipipe.model.tp_overlap import NO_EFFECT, initialize_userbuffers

    cfg = parse_config(tiny_gpt_args(tp_comm_overlap=True, **TP2_SP), world_size=2)
    assert initialize_userbuffers(cfg, TE_HOST)
    m, t = cfg.model, cfg.training
    assert fake_te == [dict(shape=[m.seq_length * t.micro_batch_size, m.hidden_size], tp_size=2,
                            quantization_modes=["none"], ub_cfgs={}, bootstrap_backend="nccl")]
    with caplog.at_level(logging.WARNING):
        assert not initialize_userbuffers(parse_config(tiny_gpt_args(**TP2_SP), world_size=2), TE_HOST)
        assert not initialize_userbuffers(cfg, CUDA_NO_TE)
        assert not initialize_userbuffers(cfg, CPU)
        assert not initialize_userbuffers(cfg, CPU, rank=1)  # one notice per run: rank 0's
    assert len(fake_te) == 1
    assert [r.getMessage() for r in caplog.records] == [NO_EFFECT, NO_EFFECT]
