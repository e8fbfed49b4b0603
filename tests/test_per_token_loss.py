"""--calculate-per-token-loss and --grad-reduce-in-bf16.

Uneven loss masks (harness/per_token.py: sample i keeps 1 to 32 loss tokens, then
--eod-mask-loss on packed documents with --reset-attention-mask / --reset-position-ids),
so the microbatches and the data-parallel ranks of a global batch hold very different
numbers of loss tokens. float32, dropout off, 2 optimizer steps, one validation batch.

1. The one-process run with the flag logs, for iteration 1, sum(masked token losses) /
   count over the global batch computed directly from the batches it read, and holds its
   gradient (torch.autograd.grad of that quotient); its validation loss is the same
   quotient over the validation batch. Without the flag the loss and gradient differ
   (the mean of the microbatch means): the check can fail.
2. Every schedule with the flag (none at DP=2, 1F1B, interleaved, the three WeiPipe rings,
   FSDP2, Ulysses CP=2, FPDT CP=2 with 4 chunks) gives the losses, every gradient of every
   iteration, the parameters after 2 steps and the validation loss of that one-process run.
3. --grad-reduce-in-bf16 under --bf16: bf16 gradient buffers, the data-parallel reduction's
   bytes halve (DDP's all-reduce, WeiPipe's ring sum of the replicated parameters, FSDP2's
   reduce-scatter), the losses stay near the fp32-reduce run's.
4. Every run trains under the GPU rules of tests/test_gpu_discipline.py: no host sync
   inside forward-backward, no host tensor in a would-be NCCL collective.
One spawn per world size (1 and 2) serves every check.
"""

from __future__ import annotations

import pytest

from harness import run_distributed
from harness.gpu_rules import FORWARD_BACKWARD
from harness.per_token import train_many
from harness.runs import tiny_gpt_args
from harness.state import assemble, max_relative_difference

from megatron_weipipe.arguments import parse_config

# Uneven masks on packed documents; 4 layers so interleaving has 2 virtual stages per rank.
# No biases: the key bias gets only rounding noise as gradient, which Adam scales up to
# updates that differ per layout (tests/test_foundation_parity.py).
SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=1,
             global_batch_size=4, train_iters=2, untie_embeddings_and_output_weights=True, disable_bias_linear=True,
             reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True, eval_iters=1, eval_interval=2)
PER_TOKEN = dict(SHAPE, calculate_per_token_loss=True)
# Against the one-process run: the parity tests' tolerances, 1e-6 (tests/test_foundation_parity.py,
# measured here up to 2.7e-7) and, for Ulysses / FPDT, whose attention and loss sum in
# another order, 1e-5 (tests/test_long_context_parity.py, measured 3.9e-6).
RTOL = 1e-6
CP_RTOL = 1e-5
# The hand computation sums the same token losses in another order (measured 5.5e-7 on
# the gradient, 2e-8 on the loss).
HAND_RTOL = 2e-6
LAYOUTS = {
    "none-dp2": dict(),
    "1f1b-pp2": dict(pipeline_model_parallel_size=2),
    "interleaved-pp2-vpp2": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    "weipipe-naive-ring2": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-naive"),
    "weipipe-interleave-ring2": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave"),
    "weipipe-zb-ring2": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb"),
    "fsdp2-dp2": dict(use_torch_fsdp2=True),
    "ulysses-cp2": dict(context_parallel_size=2),
    "fpdt-cp2-4chunks": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=8),
}
# --bf16 runs, each with fp32 and with bf16 gradient reduction.
BF16 = {
    "ddp-dp2": dict(bf16=True),
    "weipipe-ring2": dict(bf16=True, pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave"),
    "fsdp2-dp2": dict(bf16=True, use_torch_fsdp2=True),
}
# bf16 gradient reduction against fp32 after one step: the loss of iteration 2 (measured
# 6.1e-6 DDP, 5.7e-6 WeiPipe, 3.8e-7 FSDP2 relative; the step itself moves it by 5e-3).
BF16_LOSS_RTOL = 1e-4


def _bf16_runs() -> dict[tuple[str, bool], list[str]]:
    return {(name, reduce_bf16): tiny_gpt_args(**SHAPE, **flags, grad_reduce_in_bf16=reduce_bf16)
            for name, flags in BF16.items() for reduce_bf16 in (False, True)}


@pytest.fixture(scope="module")
def one_process():
    """The reference with the flag and the negative control without it, each with its hand computation."""
    runs = run_distributed(train_many, 1, [tiny_gpt_args(**PER_TOKEN), tiny_gpt_args(**SHAPE)], hand=True,
                           timeout=600)[0]
    for run in runs:  # the one rank's shards, as full tensors
        run.update(_merged([run], fsdp=False))
    return {"per-token": runs[0], "mean": runs[1]}


@pytest.fixture(scope="module")
def world2():
    argvs = {name: tiny_gpt_args(**PER_TOKEN, **flags) for name, flags in LAYOUTS.items()}
    argvs.update(_bf16_runs())
    per_rank = run_distributed(train_many, 2, list(argvs.values()), timeout=900)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(argvs)}


def _close(a, b, rtol):
    return abs(a - b) <= rtol * abs(b)


def test_per_token_loss_is_the_hand_computation(one_process):
    run, hand = one_process["per-token"], one_process["per-token"]["hand"]
    assert hand["grads_untouched"]  # the hand gradient left the trainer's buffers alone
    assert _close(run["losses"][0], hand["loss"], HAND_RTOL), (run["losses"][0], hand["loss"])
    rel, where = max_relative_difference(hand["grads"], run["grads_by_name"][1])
    assert rel < HAND_RTOL, f"gradient of {where} differs from the hand computation by {rel:.2e}"
    assert _close(run["validation"][0], hand["valid"], HAND_RTOL), (run["validation"], hand["valid"])


def test_without_the_flag_loss_and_gradient_differ(one_process):
    """The negative control: the same batches, the mean of the microbatch means."""
    per_token, mean = one_process["per-token"], one_process["mean"]
    assert not _close(mean["losses"][0], per_token["hand"]["loss"], 1e-4), mean["losses"][0]
    assert not _close(mean["validation"][0], per_token["hand"]["valid"], 1e-4)
    rel, _ = max_relative_difference(mean["grads_by_name"][1], per_token["grads_by_name"][1])
    assert rel > 0.1


def _merged(ranks: list[dict], fsdp: bool) -> dict:
    if fsdp:  # every rank gathered the full tensors by name
        return {"grads": ranks[0]["grads"], "params": ranks[0]["params"]}
    return {"grads": {it: assemble(r["grads"][it] for r in ranks) for it in ranks[0]["grads"]},
            "params": assemble(r["params"] for r in ranks)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_schedule_matches_the_one_process_run(layout, world2, one_process):
    ref, ranks = one_process["per-token"], world2[layout]
    fsdp, rtol = "fsdp" in layout, CP_RTOL if "cp2" in layout else RTOL
    for r in ranks:  # every rank logs the same training and validation losses
        assert len(r["losses"]) == 2 and len(r["validation"]) == 1
        for got, want in zip(r["losses"] + r["validation"], ref["losses"] + ref["validation"]):
            assert _close(got, want, rtol), (r["losses"], r["validation"], ref["losses"], ref["validation"])
    run = _merged(ranks, fsdp)
    ref_grads = ref["grads_by_name"] if fsdp else ref["grads"]
    for it, want in ref_grads.items():
        rel, where = max_relative_difference(run["grads"][it], want)
        assert rel < rtol, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(run["params"], ref["params_by_name"] if fsdp else ref["params"])
    assert rel < rtol, f"parameter {where} differs by {rel:.2e} after 2 steps"


def _sent(ranks: list[dict], kind: str) -> int:
    """What rank 0 sent of ``kind`` in iteration 1 up to the optimizer step."""
    return ranks[0]["sent"][1].get(kind, 0)


def _losses_close(fp32: list[dict], bf16: list[dict]) -> None:
    a, b = fp32[0]["losses"], bf16[0]["losses"]
    assert a[0] == b[0]  # the first forward runs before any reduction
    assert a[1] != b[1] and _close(b[1], a[1], BF16_LOSS_RTOL), (a, b)


def test_grad_reduce_in_bf16_ddp(world2):
    """DDP's all-reduce of its gradient buffer: 4 bytes an element, then 2; the other
    collectives (the iteration's loss reduction) are the same in both runs."""
    fp32, bf16 = world2[("ddp-dp2", False)], world2[("ddp-dp2", True)]
    assert fp32[0]["grad_buffers"]["dtypes"] == ["torch.float32"]
    assert bf16[0]["grad_buffers"]["dtypes"] == ["torch.bfloat16"]
    numel = bf16[0]["grad_buffers"]["numel"]
    assert numel == fp32[0]["grad_buffers"]["numel"] > 0
    assert _sent(fp32, "collectives") - _sent(bf16, "collectives") == 2 * numel
    _losses_close(fp32, bf16)


def test_grad_reduce_in_bf16_weipipe(world2):
    """At ring 2 x DP 1 the ring's sum of the replicated parameters' gradients (embedding,
    final norm, output layer) is grad_sync.py's reduction: in DDP's buffer dtype; the
    circulating gradients keep --weipipe-grad-dtype (fp32)."""
    fp32, bf16 = world2[("weipipe-ring2", False)], world2[("weipipe-ring2", True)]
    assert fp32[0]["grad_buffers"]["dtypes"] == ["torch.float32"]
    assert bf16[0]["grad_buffers"]["dtypes"] == ["torch.bfloat16"]
    replicated = bf16[0]["grad_buffers"]["replicated_numel"]
    assert replicated > 0
    assert _sent(fp32, "collectives") - _sent(bf16, "collectives") == 2 * replicated
    assert _sent(fp32, "gradients") == _sent(bf16, "gradients") > 0
    _losses_close(fp32, bf16)


def test_grad_reduce_in_bf16_fsdp2(world2):
    """FSDP2's reduce-scatters run in bf16 and hold half the bytes; ctx.bytes' fsdp count
    (group size - 1 = 1 times each reduce-scatter's output) drops by exactly that half."""
    fp32, bf16 = world2[("fsdp2-dp2", False)], world2[("fsdp2-dp2", True)]
    rs32, rs16 = fp32[0]["reduce_scatters"][1], bf16[0]["reduce_scatters"][1]
    assert {d for d, _ in rs32} == {"torch.float32"} and {d for d, _ in rs16} == {"torch.bfloat16"}
    half = sum(n for _, n in rs16)
    assert sum(n for _, n in rs32) == 2 * half > 0
    assert _sent(fp32, "fsdp") - _sent(bf16, "fsdp") == half
    _losses_close(fp32, bf16)


# Under Ulysses / FPDT --reset-attention-mask finds the document boundaries in the data
# loader's batch before it moves to the device (model/long_context.py shard_for_context_parallel):
# host tensors, which the counter cannot tell from device ones (made by the loader, not by
# a call it observes).
DATA_LOADER_READS = "megatron_weipipe/fpdt/documents.py"


def test_no_host_sync_inside_forward_backward(one_process, world2):
    """Every run above ran under tests/test_gpu_discipline.py's two GPU rules: the token
    counts stay on the device until the iteration's one reduction, and no collective
    (the CP sum of the reported pairs among them) is handed a host tensor."""
    runs = {**{f"one-process {k}": [v] for k, v in one_process.items()}, **{str(k): v for k, v in world2.items()}}
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            rules = r["gpu_rules"]
            assert rules["iterations"] == 2
            inside = {site: n for site, n in rules["syncs"].get(FORWARD_BACKWARD, {}).items()
                      if DATA_LOADER_READS not in site}
            assert not inside, f"{name}, rank {rank}: host syncs inside forward_backward: {inside}"
            assert not rules["host_tensors"], f"{name}, rank {rank}: " + "\n".join(rules["host_tensors"])


@pytest.mark.parametrize("flags,expected", [
    (dict(bf16=True), True),
    (dict(bf16=True, grad_reduce_in_bf16=True), False),
    (dict(bf16=True, grad_reduce_in_bf16=True, accumulate_allreduce_grads_in_fp32=True), False),
    (dict(fp16=True), False),
    (dict(fp16=True, accumulate_allreduce_grads_in_fp32=True), True),
    (dict(grad_reduce_in_bf16=True), True),
])
def test_megatron_lm_rule_for_the_gradient_dtype(flags, expected):
    """Megatron-LM's arguments.py: fp32 under --bf16 unless --grad-reduce-in-bf16 (which wins),
    fp16 under --fp16 without --accumulate-allreduce-grads-in-fp32, fp32 in fp32 training."""
    assert parse_config(tiny_gpt_args(**flags)).training.grad_reduce_in_fp32 is expected
