"""--cp-comm-type: a2a is this package's Ulysses/FPDT on every host; p2p, allgather and
a2a+p2p are megatron-core's own context parallelism inside Transformer Engine's attention,
which no CPU host can run. What a CPU can check of that path is checked here: the rules, the
one-line refusal on hosts without TE, the TransformerConfig a faked TE GPU host gets, and the
load-balanced batch split (each rank keeps chunks i and 2 x CP - 1 - i of the sequence)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.model.layer_choice import check_host
from megatron_weipipe.platform import Platform

TE_HOST = Platform("cuda", "nccl", transformer_engine=True, capability=(9, 0))
CPU = Platform("cpu", "gloo")
RING = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]


def _cfg(*extra, world_size=2):
    return parse_config(tiny_gpt_args() + list(extra), world_size=world_size)


def test_a2a_is_the_default_and_is_ulysses():
    cfg = _cfg("--context-parallel-size", "2")
    assert cfg.parallel.cp_comm_type == ["a2a"] and not cfg.parallel.megatron_context_parallel
    check_host(cfg, CPU)  # Ulysses runs on every host


def test_megatron_cp_reaches_the_transformer_config_of_a_te_host():
    from megatron_weipipe.model.gpt import build_transformer_config

    ring = _cfg(*RING)
    check_host(ring, TE_HOST)
    tconf = build_transformer_config(ring, platform=TE_HOST)
    assert (tconf.context_parallel_size, tconf.cp_comm_type) == (2, "p2p")
    ulysses = build_transformer_config(_cfg("--context-parallel-size", "2"), platform=TE_HOST)
    assert ulysses.context_parallel_size == 1  # Ulysses runs around megatron-core's attention
    per_layer = build_transformer_config(_cfg("--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a",
                                              "p2p", "a2a"), platform=TE_HOST)
    assert per_layer.cp_comm_type == ["p2p", "a2a", "p2p", "a2a"]


@pytest.mark.parametrize("extra, world_size, line", [
    (["--cp-comm-type", "a2a+p2p"], 2, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--hierarchical-context-parallel-sizes", "2", "1"], 2, "--hierarchical-context-parallel-sizes needs"),
    (["--cp-comm-type", "p2p", "a2a"], 2, "--cp-comm-type takes one value or one per layer (4), not 2"),
    (["--cp-comm-type", "p2p", "--fpdt"], 2, "--fpdt is chunked Ulysses attention: it takes --cp-comm-type a2a"),
    (["--cp-comm-type", "allgather", "--reset-attention-mask"], 2, "--reset-attention-mask cannot be combined"),
    (["--cp-comm-type", "p2p", "--seq-length", "34"], 2, "must be divisible by 2 x --context-parallel-size (4)"),
    (["--cp-comm-type", "p2p", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "weipipe-zb"], 4,
     "--pipeline-schedule weipipe-zb cannot run --cp-comm-type p2p"),
])
def test_what_megatron_cp_cannot_run_is_one_line(extra, world_size, line):
    with pytest.raises(ConfigError) as e:
        _cfg("--context-parallel-size", "2", *extra, world_size=world_size)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_hierarchical_sizes_are_taken_with_a2a_p2p():
    cfg = _cfg("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
               "2", "2", world_size=4)
    assert cfg.parallel.megatron_context_parallel and cfg.parallel.hierarchical_context_parallel_sizes == [2, 2]


def test_a_host_without_transformer_engine_refuses_megatron_cp_before_any_process_group():
    with pytest.raises(ConfigError, match="--cp-comm-type p2p is megatron-core's context parallelism"):
        check_host(_cfg(*RING), CPU)
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *tiny_gpt_args(), *RING], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                           "WORLD_SIZE": "2"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and "runs on every host" in out.stderr


def test_each_rank_keeps_chunks_i_and_2cp_minus_1_minus_i():
    """The split megatron-core's TE attention expects, through this package's forward step."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_weipipe.model.megatron_cp import MegatronContextParallel

    cp, s = 2, 16
    tokens = torch.arange(2 * s).view(2, s)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, s), "position_ids": tokens % s,
             "attention_mask": None}
    pieces = []
    for rank in range(cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            got = MegatronContextParallel(dist.group.WORLD, cp, rank).shard(batch)
        finally:
            dist.destroy_process_group()
        chunk = s // (2 * cp)
        first, last = rank * chunk, (2 * cp - 1 - rank) * chunk
        expected = torch.cat([tokens[:, first:first + chunk], tokens[:, last:last + chunk]], dim=1)
        assert torch.equal(got["tokens"], expected) and torch.equal(got["labels"], expected + 1)
        assert got["attention_mask"] is None
        pieces.append(got["tokens"])
    assert sorted(torch.cat(pieces, dim=1)[0].tolist()) == list(range(s))  # every position once
