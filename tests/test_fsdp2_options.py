"""--use-torch-fsdp2's options: HSDP (--num-distributed-optimizer-instances), no reshard after
forward, and one gradient sync per iteration, against one process, their bytes, their
checkpoints and their memory in the dry run.

World 4 = 2 replica groups x 2 shards, a tiny Llama-style model (untied, GQA, SwiGLU,
RMSNorm, RoPE), float32, dropout off, 3 iterations of 2 microbatches a rank, clipping
active: losses, gradient norms, every gradient of the first iteration and every final
parameter equal the single process within 1e-5 relative (fp32 summation order only). The
fsdp bytes of each iteration equal the closed form of the shard sizes
(fsdp2_options_bytes). The HSDP run's checkpoint of iteration 2 resumes under plain FSDP2
over the 4 ranks where the uninterrupted run ends.
The dry run of HSDP with both options holds the closed form's shards and gathered
weights (megatron_weipipe/model/fsdp_memory.py). One spawned world of 4 and, alongside
it, one single process that then runs the dry run.
"""

from __future__ import annotations

import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import run_distributed
from harness.runs import tiny_gpt_args
from harness.fsdp_units import numels_per_unit
from harness.state import max_relative_difference

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError

RTOL = 1e-5
MODEL = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    seq_length=32, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, make_vocab_size_divisible_by=128, micro_batch_size=1, global_batch_size=8,
    untie_embeddings_and_output_weights=True, clip_grad=0.5,
)
FSDP = dict(use_torch_fsdp2=True)
HSDP = dict(FSDP, num_distributed_optimizer_instances=2)
OPTIONS = dict(torch_fsdp2_no_reshard_after_forward=True, torch_fsdp2_no_grad_sync_per_microbatch=True)
WORLD, REPLICAS, MICROBATCHES = 4, 2, 2


def _args(**overrides):
    return tiny_gpt_args(**{**MODEL, "log_interval": 1, **overrides})


def _train(rank, world_size, argv):
    """pretrain() on this rank: losses, grad norms, full final parameters, bytes per iteration."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    seen, logged = {}, []

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().numpy().copy()

    def after_backward(iteration, schedule):  # the first iteration's reduced gradients
        seen["schedule"] = schedule
        if "grads" not in seen:
            seen["grads"] = {name: full(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
                             for chunk in schedule.model_chunks for name, p in chunk.module.named_parameters()}

    state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=after_backward,
                     on_log=lambda stats: logged.append(dict(stats["bytes_sent"])))
    params, local = {}, {}
    for chunk in seen["schedule"].model_chunks:
        for name, p in chunk.module.named_parameters():
            params[name] = full(p)
            if hasattr(p, "to_local"):
                local[name] = p.to_local().numel()
    parallel_state.destroy_model_parallel()
    return {"losses": state.losses, "grad_norms": state.grad_norms, "params": params, "bytes": logged,
            "local": local, "grads": seen["grads"]}


def _run_world(rank, world_size, argvs, ckpt):
    """The runs in order; before the last, the checkpoint directory points back at iteration 2
    (the first run saved iterations 2 and 3), so that it resumes from there."""
    import torch.distributed as dist

    from megatron_weipipe.training.checkpoint.directory import TRACKER

    out = [_train(rank, world_size, argv) for argv in argvs[:-1]]
    if rank == 0:
        with open(os.path.join(ckpt, TRACKER), "w") as f:
            f.write("2")
    dist.barrier()
    return out + [_train(rank, world_size, argvs[-1])]


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as ckpt:
        world = {
            "hsdp": _args(**HSDP, save=ckpt, save_interval=2),
            "hsdp-options": _args(**HSDP, **OPTIONS),
            "fsdp<-hsdp": _args(**FSDP, load=ckpt),  # plain FSDP2 over all 4 ranks, from iteration 2
        }
        with ThreadPoolExecutor(1) as pool:  # the single process starts alongside the world of 4
            reference = pool.submit(run_distributed, _reference_then_dry_run, 1, timeout=240)
            per_rank = run_distributed(_run_world, WORLD, list(world.values()), ckpt, timeout=240)
            out = {name: [r[i] for r in per_rank] for i, name in enumerate(world)}
            out["reference"], out["dry_run"] = reference.result()[0]
        return out


# tools/dry_run.py's run: HSDP with both options, --bf16, 2 microbatches a rank. Its model:
# NullTokenizer's 1025 ids padded to 1152, learned positions, biases, LayerNorm.
H, SEQ, VOCAB, LAYERS = 64, 64, 1152, 2
DRY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
       "--global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --lr 1e-3 "
       "--train-iters 1 --bf16 --hidden-dropout 0 --attention-dropout 0 --use-torch-fsdp2 "
       "--untie-embeddings-and-output-weights --num-distributed-optimizer-instances 2 "
       "--torch-fsdp2-no-reshard-after-forward --torch-fsdp2-no-grad-sync-per-microbatch").split()


def _reference_then_dry_run(rank, world_size):
    """The one-process run, then (in the same process, one start-up less) rank 0 of the dry
    run on 4 fake ranks: tools/dry_run.py brings its own fake process group."""
    import torch.distributed as dist

    from tools.dry_run import dry_run

    reference = _train(rank, world_size, _args())
    dist.destroy_process_group()
    return reference, dry_run(DRY, world_size=WORLD, rank=0)


def _close(run, ref):
    losses = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    norms = max(abs(a - b) / abs(b) for a, b in zip(run["grad_norms"], ref["grad_norms"]))
    params, where = max_relative_difference(run["params"], ref["params"])
    grads, grad_where = max_relative_difference(run["grads"], ref["grads"])
    assert len(run["losses"]) == len(ref["losses"]) == 3
    assert losses < RTOL and norms < RTOL and params < RTOL, (losses, norms, params, where)
    assert grads < RTOL, (grads, grad_where)
    return losses, norms, grads, params


@pytest.mark.parametrize("name", ["hsdp", "hsdp-options"])
def test_matches_single_process(runs, name):
    assert runs["reference"]["grad_norms"][0] > MODEL["clip_grad"]  # clipping is exercised
    worst = [max(d) for d in zip(*(_close(r, runs["reference"]) for r in runs[name]))]  # every rank
    print(f"{name}: relative differences to one process: losses {worst[0]:.1e}, grad norms {worst[1]:.1e}, "
          f"first gradients {worst[2]:.1e}, parameters {worst[3]:.1e}")


def fsdp2_options_bytes(unit_shards: list[int], shards: int, replicas: int, microbatches: int,
                        gathers_per_microbatch: int, reductions: int, compute_bytes: int = 4,
                        reduce_bytes: int = 4) -> int:
    """Bytes one rank sends in an iteration, closed form: every unit's local shard of n
    elements is all-gathered inside its shard group (S - 1 shards sent), twice a
    microbatch (forward, backward) or once without reshard after forward; its gradient is
    reduce-scattered there (S - 1 shards), then all-reduced across the replicas (a ring:
    2 (R - 1) / R of the shard), once a microbatch or once an iteration."""
    per_element = (microbatches * gathers_per_microbatch * compute_bytes * (shards - 1)
                   + reductions * reduce_bytes * (shards - 1))
    total = sum(n * per_element for n in unit_shards)
    return total + sum(reductions * 2 * (replicas - 1) * n * reduce_bytes // replicas for n in unit_shards)


def _unit_shards(local: dict[str, int]) -> list[int]:
    return list(numels_per_unit(local).values())


@pytest.mark.parametrize("name, gathers, reductions", [("hsdp", 2, MICROBATCHES), ("hsdp-options", 1, 1)])
def test_bytes_follow_the_closed_form(runs, name, gathers, reductions):
    result = runs[name][0]
    shards = WORLD // REPLICAS
    full = sum(p.size for p in result["params"].values())
    assert sum(result["local"].values()) * shards == full  # each rank holds 1 / S of every unit
    expected = fsdp2_options_bytes(_unit_shards(result["local"]), shards, REPLICAS, MICROBATCHES, gathers,
                                   reductions)
    assert len(result["bytes"]) == 3
    for logged in result["bytes"]:
        assert logged.get("fsdp") == expected, (logged, expected)
    print(f"{name}: {expected} B sent per rank per iteration")


def test_hsdp_checkpoint_resumes_under_plain_fsdp2(runs):
    uninterrupted, resumed = runs["hsdp"][0], runs["fsdp<-hsdp"][0]
    assert len(resumed["losses"]) == 1  # iteration 3 only
    assert math.isclose(resumed["losses"][0], uninterrupted["losses"][2], rel_tol=RTOL)
    params, where = max_relative_difference(resumed["params"], uninterrupted["params"])
    assert params < RTOL, (params, where)


@pytest.mark.parametrize("overrides, needle", [
    (dict(torch_fsdp2_no_reshard_after_forward=True), "--torch-fsdp2-no-reshard-after-forward needs"),
    (dict(torch_fsdp2_no_grad_sync_per_microbatch=True), "--torch-fsdp2-no-grad-sync-per-microbatch needs"),
    (dict(num_distributed_optimizer_instances=3, **FSDP), "must divide data x context parallel size"),
])
def test_refusals(overrides, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_args(**overrides), world_size=4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_dry_run_memory_follows_the_closed_form(runs):
    """The dry run of HSDP (S = 2 of 4 ranks) without reshard after forward: fp32 gradient
    shards of half the model (plain FSDP2: a quarter), and at the peak the fp32 weight
    shards plus every unit's bf16 weights (and one layer's all-gather buffer)."""
    from megatron_weipipe.model.fsdp_memory import FsdpUnits, fsdp2_rank_bytes

    out = runs["dry_run"]
    layer = 2 * H + (3 * H * H + 3 * H) + (H * H + H) + 2 * H + (4 * H * H + 4 * H) + (4 * H * H + H)
    units = FsdpUnits(embedding=VOCAB * H + SEQ * H, layer=layer, layers=LAYERS, root=VOCAB * H + 2 * H)
    closed = fsdp2_rank_bytes(units, WORLD, REPLICAS, compute_bytes=2, reshard_after_forward=False,
                              grad_sync_per_microbatch=False, microbatches=MICROBATCHES)
    plain = fsdp2_rank_bytes(units, WORLD, compute_bytes=2)
    assert closed.grad_shards == 2 * plain.grad_shards == 4 * units.total // 2
    assert out["category_peaks"]["gradients"] == closed.grad_shards
    assert out["categories"]["parameters"] == closed.param_shards + closed.gathered
    # Adam's moments, plus a 4-byte step count per parameter tensor
    assert 0 <= out["categories"]["optimizer_state"] - closed.optimizer_state < 4 * 64
