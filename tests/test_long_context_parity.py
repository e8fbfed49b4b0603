"""Ulysses and FPDT inside the GPT model against the single-process reference.

A Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, no biases), float32, dropout off:
3 optimizer steps with context parallelism (plain Ulysses, FPDT with several chunks, with
host offload, with TP and under Megatron's 1F1B pipeline) give the losses, every gradient
and every parameter of the CP=1 run without FPDT within 1e-5 relative.
"""

import pytest

from megatron_weipipe.config import ConfigError
from megatron_weipipe.arguments import parse_config
from harness import run_distributed
from harness.runs import merge_ranks, tiny_gpt_args, train_many
from harness.state import max_relative_difference

RTOL = 1e-5

LLAMA = dict(
    num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
    seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4,
)


def _args(**overrides):
    flags = dict(LLAMA)
    flags.update(overrides)
    return tiny_gpt_args(**flags)


@pytest.fixture(scope="module")
def reference():
    return merge_ranks(run_distributed(train_many, 1, [_args()], timeout=300), 0)


WORLD2 = {
    "ulysses-cp2": dict(context_parallel_size=2),
    "fpdt-cp2-4chunks": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
    "fpdt-cp2-2chunks-offload": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=32, fpdt_offload=True),
    "fpdt-cp1-4chunks": dict(fpdt=True, fpdt_chunk_size=16, data_parallel_note=None),
}
WORLD4 = {
    "fpdt-tp2-cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2, fpdt=True, fpdt_chunk_size=16,
                         make_vocab_size_divisible_by=256),
    "fpdt-cp2-1f1b-pp2": dict(context_parallel_size=2, pipeline_model_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
    "fpdt-cp2-weipipe-ring2": dict(context_parallel_size=2, pipeline_model_parallel_size=2, fpdt=True,
                                   fpdt_chunk_size=16, pipeline_schedule="weipipe-interleave"),
    "ulysses-cp2-weipipe-zb-ring2": dict(context_parallel_size=2, pipeline_model_parallel_size=2,
                                         pipeline_schedule="weipipe-zb"),
}


def _clean(overrides):
    return {k: v for k, v in overrides.items() if k != "data_parallel_note"}


@pytest.fixture(scope="module")
def world2():
    per_rank = run_distributed(train_many, 2, [_args(**_clean(o)) for o in WORLD2.values()], timeout=600)
    return {name: merge_ranks(per_rank, i) for i, name in enumerate(WORLD2)}


@pytest.fixture(scope="module")
def world4():
    per_rank = run_distributed(train_many, 4, [_args(**_clean(o)) for o in WORLD4.values()], timeout=600)
    return {name: merge_ranks(per_rank, i) for i, name in enumerate(WORLD4)}


def _check(run, reference):
    assert len(run["losses"]) == 3
    for a, b in zip(run["losses"], reference["losses"]):
        assert abs(a - b) <= RTOL * abs(b), (run["losses"], reference["losses"])
    for it, ref in reference["grads"].items():
        rel, where = max_relative_difference(run["grads"][it], ref)
        assert rel < RTOL, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(run["params"], reference["params"])
    assert rel < RTOL, f"parameter {where} differs by {rel:.2e}"


@pytest.mark.parametrize("layout", list(WORLD2))
def test_world2(layout, world2, reference):
    _check(world2[layout], reference)


@pytest.mark.parametrize("layout", list(WORLD4))
def test_world4(layout, world4, reference):
    _check(world4[layout], reference)


@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        (dict(fpdt=True, fpdt_chunk_size=128), 1, "--fpdt-chunk-size (128) must not exceed --seq-length (64)"),
        (dict(fpdt=True, fpdt_chunk_size=24), 1, "--seq-length (64) must be a multiple of --fpdt-chunk-size (24)"),
        (dict(context_parallel_size=16), 16, "--num-attention-heads (8) must be divisible by context x tensor"),
        (dict(context_parallel_size=4, num_attention_heads=12, num_query_groups=3, hidden_size=96), 4,
         "--num-query-groups (3) must divide or be divisible by context x tensor parallel size (4 x 1)"),
        (dict(context_parallel_size=2, attention_dropout=0.1), 2, "--attention-dropout must be 0"),
        (dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=33, seq_length=66), 2,
         "must be divisible by --context-parallel-size"),
    ],
)
def test_bad_long_context_configs(overrides, world, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(_args(**overrides), world_size=world)
    assert expected in str(info.value) and "\n" not in str(info.value)
