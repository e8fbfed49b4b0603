"""Two GPU rules a CPU run cannot feel, checked over real training runs of every schedule.

1. **No host tensor in an NCCL collective.** NCCL serves device tensors only ("No backend
   type associated with device type cpu"); gloo takes host tensors, so on a CPU host the
   iteration-end all-reduce of host-made flags ran, and every NCCL run would have crashed
   at the end of iteration 1 (and in evaluation). harness/devices.py follows where each
   tensor would live on a GPU host and records every would-be NCCL call handed a host
   tensor; the rule the code follows is megatron_weipipe/host_values.py's.
2. **No host sync inside forward-backward.** ``if not torch.isfinite(loss)`` in the loss
   function waited for the GPU once per microbatch; inside WeiPipe's loss step that posts
   the next tick's sends and receives late. harness/syncs.py counts Python-level
   read-backs (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()`` ...) of tensors a GPU
   host would hold on the device, by training-loop phase. Inside ``forward_backward``
   there must be none; the ones per iteration are listed below (``PER_ITERATION``).

The runs cover every schedule of the registry (each at the first layout its rules accept)
and the other paths that bring collectives or syncs of their own: evaluation, checkpoint
save and load, the distributed optimizer, FSDP2, TP = 2, Ulysses and FPDT with offload,
whole-model layer offload. Two ranks, tiny models, three iterations.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from harness.devices import DeviceDiscipline
from harness.gpu_rules import FORWARD_BACKWARD, train_under_gpu_rules
from harness.runs import tiny_gpt_args
from harness.syncs import SyncCounter

WORLD = 2
ITERATIONS = 3
# Phases of the training loop (faults.set_phase) that run once per run, not per iteration.
SETUP = ("start-up", "loading checkpoint", "building datasets", "checkpoint save", "shutdown")
# The host syncs of one iteration, outside forward_backward: (phase, site without its line)
# -> calls per iteration (per validation run for "validation").
PER_ITERATION = {
    # the loss sum and count, the NaN/Inf count and the exit flags, one reduced vector
    ("forward/backward", "Tensor.tolist at megatron_weipipe/host_values.py in all_reduce_values"): 1,
    # megatron-core's gradient norm, which decides clipping and the step
    ("optimizer step", "Tensor.item at megatron/core/optimizer/clip_grads.py in get_grad_norm_fp32"): 1,
    ("validation", "Tensor.tolist at megatron_weipipe/host_values.py in all_reduce_values"): 1,
}
# Each schedule at the first of these layouts its rules accept (2 ranks).
LAYOUTS = (dict(), dict(pipeline_model_parallel_size=2),
           dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1))
EVAL = dict(eval_iters=1, eval_interval=2)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform")


def _schedule_runs() -> dict[str, dict]:
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.config import ConfigError
    from megatron_weipipe.schedules import registry

    runs = {}
    for name in registry.names():
        for layout in LAYOUTS:
            flags = dict(layout, pipeline_schedule=name, **EVAL)
            try:
                parse_config(tiny_gpt_args(**flags), world_size=WORLD)
            except ConfigError:
                continue
            runs[name] = flags
            break
        assert name in runs, f"{name}: no layout in LAYOUTS passes its rules"
    return runs


def _runs(ckpt: str) -> dict[str, dict]:
    runs = _schedule_runs()
    runs.update({
        "1f1b-save": dict(pipeline_model_parallel_size=2, save=f"{ckpt}/pp", save_interval=2, train_iters=2,
                          lr_decay_iters=2 + ITERATIONS),  # one schedule for the save and the resume
        "1f1b-resume": dict(pipeline_model_parallel_size=2, load=f"{ckpt}/pp", train_iters=2 + ITERATIONS,
                            lr_decay_iters=2 + ITERATIONS),
        "distributed-optimizer": dict(use_distributed_optimizer=True, save=f"{ckpt}/do", save_interval=2),
        "fsdp2": dict(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True, save=f"{ckpt}/fsdp",
                      save_interval=2, **EVAL),
        "tp2": dict(tensor_model_parallel_size=2),
        "ulysses": dict(context_parallel_size=2, **EVAL),
        "fpdt-offload": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=8, fpdt_offload=True, **EVAL),
        "layer-offload-1f1b": dict(pipeline_model_parallel_size=2, offload_layer_inputs=True, **RECOMPUTE),
        "layer-offload-weipipe": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave",
                                      offload_layer_inputs=True, **RECOMPUTE),
    })
    return runs


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as ckpt:
        runs = _runs(ckpt)
        argvs = [tiny_gpt_args(**{"train_iters": ITERATIONS, **flags}) for flags in runs.values()]
        per_rank = run_distributed(train_under_gpu_rules, WORLD, argvs, timeout=900)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(runs)}


RUN_NAMES = list(_runs("ckpt"))


@pytest.mark.parametrize("run", RUN_NAMES)
def test_no_host_tensor_reaches_an_nccl_collective(run, results):
    for rank, r in enumerate(results[run]):
        assert r["checked"] > 0  # the run made collective calls that were checked
        assert not r["host_tensors"], f"rank {rank}:\n" + "\n".join(r["host_tensors"])


@pytest.mark.parametrize("run", RUN_NAMES)
def test_no_host_sync_inside_forward_backward(run, results):
    for rank, r in enumerate(results[run]):
        inside = r["syncs"].get(FORWARD_BACKWARD, {})
        assert not inside, f"rank {rank}: host syncs inside forward_backward:\n" + "\n".join(
            f"{n} x {site}" for site, n in inside.items())


def _without_line(site: str) -> str:
    return re.sub(r":\d+ in ", " in ", site)


@pytest.mark.parametrize("run", RUN_NAMES)
def test_the_syncs_of_an_iteration_are_the_listed_ones(run, results):
    for rank, r in enumerate(results[run]):
        iterations = r["iterations"] - (2 if run == "1f1b-resume" else 0)
        validations = r["iterations"] // 2 if "eval_iters" in _runs("ckpt")[run] else 0
        for phase, sites in r["syncs"].items():
            if phase in SETUP or phase == FORWARD_BACKWARD:
                continue
            for site, calls in sites.items():
                key = (phase, _without_line(site))
                assert key in PER_ITERATION, f"rank {rank}: a host sync not in PER_ITERATION: {phase}: {site}"
                per = validations if phase == "validation" else iterations
                assert calls <= PER_ITERATION[key] * per, f"rank {rank}: {calls} x {site} in {per} {phase}s"


# -- the checks themselves can fail ------------------------------------------------------

def _host_tensor_in_all_reduce(rank, world_size):
    """What the training loop did before: flags made on the host, all-reduced."""
    discipline = DeviceDiscipline().install()
    try:
        good = torch.zeros(2, device="cuda")  # the adapter puts it on the CPU; a GPU on the device
        flags = torch.tensor([1.0, 0.0])
        from_device = good + 1
        dist.all_reduce(good)
        dist.all_reduce(from_device)
        dist.all_reduce(flags)
        dist.all_gather_object([None] * world_size, {"any": "object"})  # exempt: torch moves it
    finally:
        discipline.uninstall()
    return [str(v) for v in discipline.violations], discipline.checked_calls


def test_device_discipline_reports_a_host_tensor_in_all_reduce():
    violations, checked = run_distributed(_host_tensor_in_all_reduce, 2, timeout=120)[0]
    assert checked == 3
    assert len(violations) == 1 and violations[0].startswith("all_reduce of a host tensor [2] float32 at "), violations
    assert "test_gpu_discipline.py" in violations[0] and "made by tensor" in violations[0]


class _ReadsBackInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if g.sum() > 0:  # a bool() of a device tensor in a backward: a host sync
            return g * 2
        return g


def test_sync_counter_sees_reads_in_forward_and_backward():
    counter = SyncCounter()
    x = torch.ones(3, requires_grad=True)
    with counter, counter.region("step"):
        y = _ReadsBackInBackward.apply(x).sum()
        loss_value = y.item()
        y.backward()
        _ = torch.tensor([1.0]).tolist()
    calls = counter.in_region("step")
    kinds = sorted(site.split(" at ")[0] for site in calls)
    assert loss_value == 6.0 and kinds == ["Tensor.bool", "Tensor.item", "Tensor.tolist"], calls
    host = SyncCounter(is_host=lambda t: True)
    with host, host.region("step"):
        torch.ones(2).tolist()
    assert not host.in_region("step")  # a host tensor's read-back waits for nothing
