"""--optimizer-cpu-offload against the same run without it, its checkpoints, its rules, its dry run.

A Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, untied output layer), float32, dropout
off, 3 optimizer steps with gradient clipping active, DP=2: megatron-core's hybrid-device
optimizer (--use-distributed-optimizer, --use-precision-aware-optimizer) against the plain
distributed optimizer, and FSDP2 with CPUOffloadPolicy against FSDP2 without, give the same
losses, gradient norms, every gradient after each backward and every final parameter within
1e-6 relative. Each form engages its mechanism (the hybrid optimizer is built, FSDP2 units
carry the policy). A run saved at iteration 2 with offload resumes without it, and the
other way round, and ends where the uninterrupted run does. One spawn of two ranks.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from harness import run_distributed
from harness.runs import tiny_gpt_args
from harness.state import max_relative_difference

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.errors import ConfigError

RTOL = 1e-6
LLAMA = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    seq_length=32, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4,
    untie_embeddings_and_output_weights=True, clip_grad=1.0, lr=1e-2,
)
# megatron-core's hybrid-device optimizer takes 16-bit weights' shards: both runs --bf16 (fp32 masters)
DIST_OPT = dict(use_distributed_optimizer=True, bf16=True)
HYBRID = dict(DIST_OPT, optimizer_cpu_offload=True, use_precision_aware_optimizer=True)
FSDP = dict(use_torch_fsdp2=True)
FSDP_OFFLOAD = dict(use_torch_fsdp2=True, optimizer_cpu_offload=True)


def _args(**overrides):
    return tiny_gpt_args(**{**LLAMA, **overrides})


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().numpy().copy()


def _grads(model_chunks) -> dict:
    out = {}
    for chunk in model_chunks:
        for name, p in chunk.module.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                out[name] = _full(g)
    return out


def _train(rank, world_size, argv):
    """pretrain() on this rank: losses, grad norms, gradients after each backward, final
    parameters (full tensors), and which offload mechanism the run built."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training import run_setup
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    seen, grads, optimizers = {}, [], []
    build = run_setup.build_optimizer

    def capture(*args, **kwargs):
        optimizers.append(build(*args, **kwargs))
        return optimizers[-1]

    def after_backward(iteration, schedule):
        seen["schedule"] = schedule
        grads.append(_grads(schedule.model_chunks))

    run_setup.build_optimizer = capture
    try:
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=after_backward)
    finally:
        run_setup.build_optimizer = build
    chunks = seen["schedule"].model_chunks
    params = {name: _full(p) for chunk in chunks for name, p in chunk.module.named_parameters()}
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizers[0], "chained_optimizers", optimizers)]
    policies = {type(getattr(s._fsdp_param_group, "offload_policy", None)).__name__
                for m in chunks[0].module.modules() if hasattr(m, "_get_fsdp_state")
                for s in [m._get_fsdp_state()] if s._fsdp_param_group is not None}
    parallel_state.destroy_model_parallel()
    return {"losses": state.losses, "grad_norms": state.grad_norms, "grads": grads, "params": params,
            "hybrid": any(isinstance(o, HybridDeviceOptimizer) for o in inner), "fsdp_policies": policies}


def _run_many(rank, world_size, argvs):
    return [_train(rank, world_size, argv) for argv in argvs]


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as d:
        table = {
            "dist-opt": _args(**DIST_OPT),
            "hybrid": _args(**HYBRID),
            "fsdp": _args(**FSDP),
            "fsdp-offload": _args(**FSDP_OFFLOAD),
        }
        for name, on, off in (("dist-opt", HYBRID, DIST_OPT), ("fsdp", FSDP_OFFLOAD, FSDP)):
            for first, second, tag in ((on, off, "on-off"), (off, on, "off-on")):
                where = os.path.join(d, f"{name}-{tag}")
                table[f"{name}-save-{tag}"] = _args(**first, save=where, exit_interval=2)
                table[f"{name}-resume-{tag}"] = _args(**second, load=where)
        per_rank = run_distributed(_run_many, 2, list(table.values()), timeout=300)
        yield {name: [r[i] for r in per_rank] for i, name in enumerate(table)}


def _close(run, ref):
    """Largest relative differences of losses, grad norms, gradients and parameters."""
    assert len(run["losses"]) == len(ref["losses"]) == 3
    losses = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    norms = max(abs(a - b) / abs(b) for a, b in zip(run["grad_norms"], ref["grad_norms"]))
    grads = max(max_relative_difference(g, h)[0] for g, h in zip(run["grads"], ref["grads"]))
    params, where = max_relative_difference(run["params"], ref["params"])
    assert max(losses, norms, grads, params) < RTOL, (losses, norms, grads, params, where)


@pytest.mark.parametrize("offloaded, reference", [("hybrid", "dist-opt"), ("fsdp-offload", "fsdp")])
def test_offload_matches_the_run_without_it(runs, offloaded, reference):
    assert runs[reference][0]["grad_norms"][0] > LLAMA["clip_grad"]  # clipping is exercised
    for run, ref in zip(runs[offloaded], runs[reference]):
        assert len(run["grads"]) == len(ref["grads"]) == 3 and set(run["grads"][0]) == set(ref["params"])
        _close(run, ref)


def test_each_form_engages_its_mechanism(runs):
    assert runs["hybrid"][0]["hybrid"] and not runs["dist-opt"][0]["hybrid"]
    assert runs["fsdp-offload"][0]["fsdp_policies"] == {"CPUOffloadPolicy"}
    assert runs["fsdp"][0]["fsdp_policies"] == {"OffloadPolicy"}


@pytest.mark.parametrize("name, reference", [("dist-opt", "dist-opt"), ("fsdp", "fsdp")])
@pytest.mark.parametrize("tag", ["on-off", "off-on"])
def test_resume_across_offload_on_and_off(runs, name, reference, tag):
    uninterrupted, saved, resumed = runs[reference][0], runs[f"{name}-save-{tag}"][0], runs[f"{name}-resume-{tag}"][0]
    assert len(saved["losses"]) == 2 and len(resumed["losses"]) == 1
    assert abs(resumed["losses"][0] - uninterrupted["losses"][2]) <= RTOL * abs(uninterrupted["losses"][2])
    params, where = max_relative_difference(resumed["params"], uninterrupted["params"])
    assert params < RTOL, (params, where)


@pytest.mark.parametrize("overrides, needle", [
    (dict(optimizer_cpu_offload=True), "needs --use-distributed-optimizer"),
    (dict(DIST_OPT, optimizer_cpu_offload=True), "needs --use-precision-aware-optimizer"),
    (dict(HYBRID, bf16=False), "needs --bf16 or --fp16"),
    (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
    (dict(**HYBRID, optimizer="sgd"), "needs --optimizer adam"),
    ({**HYBRID, "optimizer_offload_fraction": 1.5}, "must be in [0, 1]"),
    (dict(**FSDP_OFFLOAD, optimizer_offload_fraction=0.5), "FSDP2's CPUOffloadPolicy keeps every shard"),
    (dict(**FSDP_OFFLOAD, overlap_cpu_optimizer_d2h_h2d=True), "FSDP2 copies its shards"),
])
def test_refuses_what_cannot_run(overrides, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_args(**overrides), world_size=2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _dry_run(*flags):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 1 "
            "--global-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --lr 1e-3 "
            "--train-iters 1 --bf16 --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights "
            "--world-size 2").split()
    p = subprocess.run([sys.executable, "-m", "tools.dry_run", *tiny, *flags, "--json"], capture_output=True,
                       text=True, timeout=120, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("form", ["fsdp2", "dist-opt"])
def test_dry_run_counts_the_host_side(form):
    """Rank 0 of 2 (vocabulary 1025 padded to 1152, learned positions). FSDP2: the fp32
    weight, gradient and two Adam moments of its shard on the host (16 B per parameter / 2),
    none of them on the device. Distributed optimizer: bf16 weights and fp32 gradient buffer
    stay on the device, its shard's fp32 master, two moments and fp32 gradient copy (16 B /
    2) go to the host. Adam's 4-byte step counters (one per tensor) sit beside the moments;
    the estimator (simulator/host_state.py) leaves them out."""
    h, vocab, n_tensors = 64, 1152, 30
    layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
    model = vocab * h + 64 * h + 2 * layer + vocab * h + 2 * h
    flags = ["--use-torch-fsdp2", "--optimizer-cpu-offload"] if form == "fsdp2" else \
        ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
    out = _dry_run(*flags)
    cats, est = out["categories"], out["estimator"]
    assert 0 <= out["host_bytes"] - 16 * model // 2 <= 4 * n_tensors, (out["host_bytes"], 16 * model // 2)
    assert 0 <= out["host_bytes"] - est["host_bytes"] <= 4 * n_tensors
    assert cats["optimizer_state"] <= 4 * n_tensors and est["categories"]["optimizer_state"] == 0
    if form == "fsdp2":
        assert out["category_peaks"]["gradients"] == 0 and est["categories"]["gradients"] == 0
    else:
        assert cats["parameters"] == 2 * model and cats["gradients"] == 4 * model
        assert est["categories"]["parameters"] == cats["parameters"]
