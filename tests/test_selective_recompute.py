"""--recompute-activations, --recompute-granularity selective and --recompute-modules: megatron-core's
selective recomputation (model/selective_recompute.py, docs/how-it-works/dry-run.md).

Each recomputed module must truly run again in backward (its forward calls are counted: twice
as many as without the flag) and change nothing else: losses, every gradient of every
iteration and every parameter equal the run without it, in float32 with dropout on (an RNG
mismatch in a recompute draws another mask), under no pipeline, 1F1B at PP=2, weipipe-zb,
Ulysses CP=2 (core_attn there is this package's kernel under megatron-core's checkpoint),
FPDT CP=2 and FSDP2. The dry run's activation bytes fall by what the estimator says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from harness import run_distributed
from harness.runs import REPO_ROOT, tiny_gpt_args, train_and_collect
from harness.state import assemble, max_relative_difference

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError

ALL = ["core_attn", "mlp", "layernorm"]
# Equal to the run without recomputation: bitwise here (LayerNorm); 1e-6 is the parity tests' bound.
RTOL = 1e-6
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1, attention_backend="unfused", num_layers=2,
               train_iters=2, make_vocab_size_divisible_by=512)
# Ulysses / FPDT take no attention dropout; the hidden dropout stays on.
LONG = dict(DROPOUT, attention_dropout=0.0, num_attention_heads=4, seq_length=64, global_batch_size=4,
            context_parallel_size=2, position_embedding_type="rope", disable_bias_linear=True)


def _selective(flags: dict, modules) -> list[str]:
    return tiny_gpt_args(**flags, recompute_granularity="selective") + ["--recompute-modules", *modules]


# ---- the flags -----------------------------------------------------------------------------------


def test_flags_follow_megatron_lm_and_refuse_what_cannot_apply():
    cfg = parse_config(tiny_gpt_args(recompute_activations=True), world_size=1)
    assert cfg.model.recompute_granularity == "selective" and cfg.model.selective_modules == ("core_attn",)
    plain = parse_config(tiny_gpt_args(), world_size=1)
    assert plain.model.selective_modules == () and plain.model.recompute_granularity is None
    refused = {
        # Megatron-LM: --recompute-activations wins over --recompute-granularity full, then its method is refused
        "--recompute-method applies": dict(recompute_activations=True, recompute_granularity="full",
                                           recompute_method="uniform"),
        "--recompute-num-layers applies": dict(recompute_granularity="selective", recompute_num_layers=1),
        "does not apply with --fpdt": dict(recompute_granularity="selective", fpdt=True, fpdt_chunk_size=16),
        "--offload-layer-inputs needs": dict(recompute_granularity="selective", offload_layer_inputs=True),
    }
    for line, flags in refused.items():
        with pytest.raises(ConfigError, match=line):
            parse_config(tiny_gpt_args(**flags), world_size=1)
    for module, kind in (("moe", "mixture-of-experts"), ("mla_up_proj", "multi-latent attention")):
        with pytest.raises(ConfigError, match=f"{module} recomputes part of a {kind} layer"):
            parse_config(_selective({}, ["mlp", module]), world_size=1)
    bad = subprocess.run([sys.executable, "pretrain_gpt.py", *_selective({}, ["core_atn"])], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--recompute-modules" in bad.stderr


def test_megatron_core_gets_the_modules_fpdt_mlp_left_to_its_chunked_mlp():
    from megatron_weipipe.model.gpt import _recompute_modules

    assert _recompute_modules(parse_config(tiny_gpt_args(), world_size=1)) is None
    assert _recompute_modules(parse_config(_selective({}, ["mlp", "layernorm"]), world_size=1)) == ["mlp", "layernorm"]
    fpdt = parse_config(_selective(dict(fpdt=True, fpdt_chunk_size=16), ["mlp"]), world_size=1)
    assert _recompute_modules(fpdt) == []  # [] is megatron-core's "recompute nothing", None its default core_attn


def test_tflops_count_no_recomputation_as_megatron_lm():
    """Megatron-LM's num_floating_point_operations: 3 x the forward's FLOPs whatever --recompute-*
    say. By hand for a GPT layer: QKV, projection and the two MLP GEMMs 24 T h^2, the attention
    (full square) 4 b s^2 h, the logits 2 T h V."""
    from megatron_weipipe.training.metrics import model_flops_per_sample

    b, s, h, L, V, n = 2, 32, 32, 4, 512, 4
    T = b * s
    by_hand = n * 3 * (L * (24 * T * h * h + 4 * b * s * s * h) + 2 * T * h * V)
    for flags in ({}, dict(recompute_activations=True),
                  dict(recompute_granularity="full", recompute_method="uniform")):
        cfg = parse_config(tiny_gpt_args(make_vocab_size_divisible_by=512, **flags), world_size=1)
        assert model_flops_per_sample(cfg, vocab_size=257) * cfg.training.global_batch_size == by_hand


def test_the_simulator_charges_each_backward_what_it_recomputes():
    """The share of a layer's forward run again in backward (python -m tools.simulate's time model),
    by hand for this GPT layer: GEMMs 24 T h^2, causal attention 2 b s^2 h, the MLP's GEMMs 16 T h^2."""
    from megatron_weipipe.simulator.run_spec import spec_from_config

    b, s, h = 2, 32, 32
    forward = 24 * b * s * h * h + 2 * b * s * s * h
    shares = {"core_attn": 2 * b * s * s * h / forward, "mlp": 16 * b * s * h * h / forward, "layernorm": 0.0}
    for module, share in shares.items():
        spec = spec_from_config(parse_config(_selective({}, [module]), world_size=1))
        assert spec.recompute_share == pytest.approx(share, rel=1e-12)
    full = parse_config(tiny_gpt_args(recompute_granularity="full", recompute_method="uniform"), world_size=1)
    assert spec_from_config(full).recompute_share == 1.0
    assert spec_from_config(parse_config(tiny_gpt_args(), world_size=1)).recompute_share == 0.0


# ---- the dry run and the estimator ------------------------------------------------------------------

DRY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
       "--tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --lr 1e-3 --train-iters 1 --bf16 "
       "--hidden-dropout 0 --attention-dropout 0 --attention-backend unfused --global-batch-size 8 "
       "--world-size 2 --pipeline-model-parallel-size 2").split()


def _dry_activations(runs: dict) -> dict:
    """name -> (the dry run's activation peak, the estimator's), the runs side by side."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, "-m", "tools.dry_run", *DRY, *flags, "--json"], cwd=REPO_ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, flags in runs.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        d = json.loads(stdout)
        out[name] = d["category_peaks"]["activations"], d["estimator"]["categories"]["activations"]
    return out


def test_dry_run_activations_fall_by_what_the_estimator_says():
    """1F1B rank 0 (two microbatches in flight), megatron-core's unfused attention: core_attn drops the
    s x s probabilities, mlp the MLP's intermediates (measured 37.8% and 12.7% of the activations;
    the estimator's drops within 1% of the measured ones)."""
    selective = ["--recompute-granularity", "selective", "--recompute-modules"]
    runs = _dry_activations({"none": [], "core_attn": selective + ["core_attn"], "mlp": selective + ["mlp"]})
    base, base_est = runs.pop("none")
    for module, (got, est) in runs.items():
        assert got < 0.9 * base, (module, got, base)
        assert abs((base_est - est) / (base - got) - 1) < 0.10, (module, base - got, base_est - est)
        assert abs(est / got - 1) < 0.10, (module, got, est)


# ---- parity --------------------------------------------------------------------------------------


def _counted_run(rank: int, world_size: int, argv: list[str]) -> dict:
    """A run with every forward call of a core attention, an MLP and a norm counted (recomputes
    included; WeiPipe's stop early, inside the module, so the calls are counted as they begin);
    FSDP2 runs bring back losses and gradient norms only."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP

    counts = {"core_attn": 0, "mlp": 0, "layernorm": 0}

    def hook(module, args):  # before the forward: a recompute that stops early is counted too
        if isinstance(module, DotProductAttention):
            counts["core_attn"] += 1
        elif isinstance(module, MLP):
            counts["mlp"] += 1
        elif isinstance(module, torch.nn.LayerNorm):
            counts["layernorm"] += 1

    from megatron_weipipe.fpdt import chunked_attention

    block = chunked_attention._BlockAttention.forward  # Ulysses' core attention: a kernel, no module

    def counted_block(*args, **kwargs):
        counts["core_attn"] += 1
        return block(*args, **kwargs)

    chunked_attention._BlockAttention.forward = staticmethod(counted_block)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        if "--use-torch-fsdp2" in argv:
            from megatron.core import parallel_state

            import pretrain_gpt
            from megatron_weipipe.model.gpt_step import forward_step
            from megatron_weipipe.training.pretrain import pretrain

            state = pretrain(parse_config(argv, world_size=world_size), pretrain_gpt.model_provider, forward_step)
            parallel_state.destroy_model_parallel()
            out = {"losses": state.losses, "grad_norms": state.grad_norms}
        else:
            out = train_and_collect(rank, world_size, argv)
    finally:
        handle.remove()
        chunked_attention._BlockAttention.forward = staticmethod(block)
    return dict(out, counts=counts)


def _runs(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    return [_counted_run(rank, world_size, argv) for argv in argvs]


def _compare(per_rank, i: int, label: str) -> dict:
    """Run i (without) against run i + 1 (with): equal losses, gradients and parameters."""
    plain, redone = ([r[j] for r in per_rank] for j in (i, i + 1))
    assert plain[0]["losses"] == pytest.approx(redone[0]["losses"], rel=RTOL, abs=0), label
    assert plain[0]["grad_norms"] == pytest.approx(redone[0]["grad_norms"], rel=RTOL, abs=0), label
    if "grads" in plain[0]:
        for it in plain[0]["grads"]:
            err, where = max_relative_difference(assemble(r["grads"][it] for r in plain),
                                                 assemble(r["grads"][it] for r in redone))
            assert err <= RTOL, (label, it, where, err)
        err, where = max_relative_difference(assemble(r["params"] for r in plain),
                                             assemble(r["params"] for r in redone))
        assert err <= RTOL, (label, where, err)
    return {k: (sum(r["counts"][k] for r in plain), sum(r["counts"][k] for r in redone))
            for k in plain[0]["counts"]}


WORLD1 = {"none, unfused": dict(DROPOUT), "none, SDPA": dict(DROPOUT, attention_backend="flash")}
WORLD2 = {
    "1f1b PP=2": (dict(DROPOUT, pipeline_model_parallel_size=2), ALL),
    "weipipe-zb PP=2": (dict(DROPOUT, pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb"), ALL),
    "Ulysses CP=2": (dict(LONG), ALL),
    "FPDT CP=2": (dict(LONG, fpdt=True, fpdt_chunk_size=16), ["mlp", "layernorm"]),
    "FSDP2 DP=2": (dict(DROPOUT, use_torch_fsdp2=True, untie_embeddings_and_output_weights=True), ALL),
}


@pytest.fixture(scope="module")
def world1():
    argvs = [a for flags in WORLD1.values() for a in (tiny_gpt_args(**flags), _selective(flags, ALL))]
    return run_distributed(_runs, 1, argvs, timeout=600)


@pytest.fixture(scope="module")
def world2():
    argvs = [a for flags, mods in WORLD2.values() for a in (tiny_gpt_args(**flags), _selective(flags, mods))]
    return run_distributed(_runs, 2, argvs, timeout=900)


def test_no_pipeline_recomputes_every_module_and_changes_nothing(world1):
    """4 microbatches x 2 layers per iteration, 2 iterations: each core attention and MLP runs once
    more in backward, each layer's two norms too (the final norm is not recomputed)."""
    for i, label in enumerate(WORLD1):
        counts = _compare(world1, 2 * i, label)
        calls = 2 * 4 * 2
        assert counts == {"core_attn": (calls, 2 * calls), "mlp": (calls, 2 * calls),
                          "layernorm": (2 * calls + 8, 4 * calls + 8)}, (label, counts)


@pytest.mark.parametrize("label", list(WORLD2))
def test_schedules_and_long_context_recompute_and_change_nothing(world2, label):
    counts = _compare(world2, 2 * list(WORLD2).index(label), label)
    for module in WORLD2[label][1]:
        plain, redone = counts[module]
        if label.startswith("FPDT") and module == "mlp":  # its chunked MLP recomputes inside itself
            assert redone == plain, counts
        elif module == "layernorm":  # the final norm (8 calls) is not recomputed; WeiPipe's form
            extra = (plain - 8) * (2 if label.startswith("weipipe") else 1)  # also runs the norm's checkpoint
            assert redone - plain == extra > 0, (label, counts)
        else:
            assert redone == 2 * plain > 0, (label, module, counts)


# ---- WeiPipe's checkpoints: the RNG replay is what keeps the dropout masks ----------------------


def _layer_grads(replay_rng: bool) -> dict:
    from megatron.core import tensor_parallel

    from megatron_weipipe.model import selective_recompute
    from megatron_weipipe.model.gpt import build_gpt_model

    cfg = parse_config(_selective(DROPOUT, ALL), world_size=1)
    model = build_gpt_model(cfg, 512, pre_process=True, post_process=True)
    out = {}
    for recompute in (False, True):
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        x = torch.randn(32, 2, 32, requires_grad=True)
        with selective_recompute.for_autograd_grad(recompute):
            layer = model.decoder.layers[0]
            layer.recompute_mlp = layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = recompute
            layer.self_attention.checkpoint_core_attention = recompute
            y, _ = layer(hidden_states=x, attention_mask=None)
        torch.manual_seed(99)  # what a backward run later would find in the generators
        grads = torch.autograd.grad(y, [x, *layer.parameters()], torch.ones_like(y))
        out[recompute] = grads
    return out


def test_weipipe_checkpoints_replay_the_forward_rng(monkeypatch):
    """The checkpoints WeiPipe's chunk forwards use backpropagate through torch.autograd.grad and
    give the gradients of the layer without recomputation (attention and hidden dropout on);
    without replaying the forward's RNG states the recompute draws other dropout masks."""
    from megatron_weipipe.model import selective_recompute
    from megatron_weipipe.training.host_calibration import single_process_megatron

    cfg = parse_config(_selective(DROPOUT, ALL), world_size=1)
    with single_process_megatron(cfg):
        grads = _layer_grads(replay_rng=True)
        for a, b in zip(grads[False], grads[True]):
            assert torch.equal(a, b)
        monkeypatch.setattr(selective_recompute, "_set_forward_rng", lambda states: None)
        broken = _layer_grads(replay_rng=False)
        assert not torch.equal(broken[False][0], broken[True][0])
