"""Megatron-LM launch-script flags: the no-op ones leave the configuration as it was, the
refused ones stop start-up with one line naming them, and docs/reference/flags.md lists all."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, fields

import pytest
from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError
from megatron_weipipe.flags import flag_name
from megatron_weipipe.megatron_compat import MegatronCompatConfig

# Megatron-LM's examples/llama/train_llama3_8b flags that carry no shape, shrunk to a CPU run.
LLAMA3_NOOPS = ("--use-mcore-models --attention-backend fused --use-flash-attn "
                "--no-masked-softmax-fusion --cross-entropy-loss-fusion --ckpt-fully-parallel-save").split()
LLAMA3 = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=2,
              use_distributed_optimizer=True, overlap_grad_reduce=True, bf16=True, ckpt_format="torch_dist",
              log_throughput=True)


def _without_compat(cfg) -> dict:
    d = asdict(cfg)
    d.pop("megatron")
    d["model"].pop("attention_backend")  # a model flag now; fused and auto select the same core attention
    return d


def test_noop_flags_leave_the_configuration_unchanged():
    plain = parse_config(tiny_gpt_args(**LLAMA3), world_size=2)
    pasted = parse_config(tiny_gpt_args(**LLAMA3) + LLAMA3_NOOPS, world_size=2)
    assert _without_compat(pasted) == _without_compat(plain)
    assert pasted.megatron.use_flash_attn and pasted.model.attention_backend == "fused"
    from megatron_weipipe.platform import Platform

    cpu = Platform("cpu", "gloo")
    assert {cpu.attention_backend(b) for b in ("fused", "auto")} <= {"flash", "fused"}


REFUSED = {
    "--use-megatron-fsdp": [], "--use-legacy-models": [],
    "--cpu-offloading": [],
}


def test_every_refused_flag_is_tested():
    assert sorted(REFUSED) == sorted(MegatronCompatConfig.refused())


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_fail_with_one_line_naming_them(flag):
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args() + [flag, *REFUSED[flag]])
    assert str(e.value).startswith(f"{flag} is not supported here") and "\n" not in str(e.value)


def test_pretrain_gpt_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *tiny_gpt_args(), "--train-samples", "1000"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: --train-iters and --train-samples cannot both be given (iteration- or sample-based training, "
        "as in Megatron-LM)"]


def test_docs_list_every_flag():
    doc = open(os.path.join(REPO_ROOT, "docs", "reference", "flags.md")).read()
    missing = [flag_name(f) for f in fields(MegatronCompatConfig) if f"`{flag_name(f)}`" not in doc]
    assert not missing, f"docs/reference/flags.md does not list {missing}"
