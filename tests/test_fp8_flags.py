"""Megatron-LM's --fp8-* flags: FP8 GEMMs through Transformer Engine where a host can run
them, one line where it cannot (no TE, an older GPU, this package's local layers), before
any process group exists. A CPU host cannot run FP8, so what runs on a GPU is checked as far
as a CPU can: the flags reach megatron-core's TransformerConfig and DDP config for a faked
Hopper host with TE, and every refusal is one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.model.layer_choice import check_host
from megatron_weipipe.platform import Platform

HOPPER_TE = Platform("cuda", "nccl", transformer_engine=True, capability=(9, 0))
AMPERE_TE = Platform("cuda", "nccl", transformer_engine=True, capability=(8, 0))
HOPPER_NO_TE = Platform("cuda", "nccl", transformer_engine=False, capability=(9, 0))
CPU = Platform("cpu", "gloo")
FP8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]


def _cfg(*extra, world_size=1):
    return parse_config(tiny_gpt_args() + list(extra), world_size=world_size)


def test_fp8_flags_reach_megatron_cores_transformer_config_on_a_te_hopper_host():
    from megatron_weipipe.model.gpt import build_transformer_config

    cfg = _cfg(*FP8, "--fp8-param-gather", "--use-distributed-optimizer")
    check_host(cfg, HOPPER_TE)
    tconf = build_transformer_config(cfg, platform=HOPPER_TE)
    assert (tconf.fp8, tconf.fp8_recipe, tconf.fp8_amax_history_len, tconf.fp8_amax_compute_algo, tconf.fp8_param) \
        == ("hybrid", "delayed", 1024, "max", True)
    plain = build_transformer_config(_cfg("--bf16"), platform=HOPPER_TE)
    assert plain.fp8 is None and not plain.fp8_param


def test_fp8_param_gather_reaches_the_ddp_config():
    from megatron_weipipe.schedules.gpt.megatron_schedules import ddp_config

    assert ddp_config(_cfg(*FP8, "--fp8-param-gather", "--use-distributed-optimizer")).fp8_param_gather
    assert not ddp_config(_cfg(*FP8, "--use-distributed-optimizer")).fp8_param_gather


@pytest.mark.parametrize("platform, extra, line", [
    (CPU, [], "--fp8-format needs Transformer Engine layers on a GPU"),
    (HOPPER_NO_TE, [], "--fp8-format needs Transformer Engine layers on a GPU"),
    (AMPERE_TE, [], "needs a GPU of compute capability 8.9 or newer; this one is 8.0"),
    (HOPPER_TE, ["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 needs a GPU of compute capability 10.0 or newer"),
    (HOPPER_TE, ["--transformer-impl", "local"], "--fp8-format needs Transformer Engine layers on a GPU"),
])
def test_hosts_that_cannot_run_fp8_are_refused_in_one_line(platform, extra, line):
    with pytest.raises(ConfigError) as e:
        check_host(_cfg(*FP8, *extra), platform)
    assert line in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra, world_size, line", [
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "weipipe-zb"], 2,
     "--pipeline-schedule weipipe-zb cannot run --fp8-format"),
    (["--context-parallel-size", "2"], 2, "--fp8-format cannot be combined with --context-parallel-size > 1"),
    (["--fp8-param-gather"], 1, "--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2"),
])
def test_layouts_without_fp8_gemms_are_refused_in_one_line(extra, world_size, line):
    with pytest.raises(ConfigError, match=line.replace("+", r"\+").replace(">", ".")):
        _cfg(*FP8, *extra, world_size=world_size)


def test_pretrain_gpt_on_this_cpu_host_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *tiny_gpt_args(), *FP8], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: --fp8-format needs Transformer Engine layers on a GPU (FP8 GEMMs are TE's); this host builds "
        "megatron-core's local layers"]
