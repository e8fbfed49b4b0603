"""The CPU core attention (torch SDPA) against megatron-core's own DotProductAttention.

Two megatron-core SelfAttention modules from the local spec, one with megatron-core's
core attention and one with SDPACoreAttention, same weights, same input, same RNG
state: the output and every gradient (input, QKV and projection weights and biases)
agree within TOL in float32. Cases: multi-head causal, grouped-query, a
--reset-attention-mask document mask, and attention dropout in training (the same mask
must be drawn, else the difference is O(1)). And the platform's rule: on a CPU host
``auto`` selects SDPA, ``local``/``unfused`` megatron-core's module.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

TOL = 1e-6  # max abs difference / max abs value of the reference, per tensor (fp32 eps is 1.2e-7)

CASES = {
    "causal": dict(heads=4, groups=4, mask=False, dropout=0.0),
    "gqa": dict(heads=4, groups=2, mask=False, dropout=0.0),
    "gqa_doc_mask": dict(heads=4, groups=1, mask=True, dropout=0.0),
    "dropout": dict(heads=4, groups=2, mask=False, dropout=0.1),
}


def _compare(rank, world, cases):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    from megatron_weipipe.model.sdpa_attention import SDPACoreAttention
    from megatron_weipipe.platform import install_cpu_adapter

    install_cpu_adapter()
    parallel_state.initialize_model_parallel()
    S, b, hidden, d = 24, 2, 32, 8
    out = {}
    for name, c in cases.items():
        cfg = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=c["heads"], num_query_groups=c["groups"],
            kv_channels=d, add_bias_linear=True, attention_dropout=c["dropout"], hidden_dropout=0.0,
            use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            params_dtype=torch.float32)
        mods = []
        for core in (DotProductAttention, SDPACoreAttention):
            spec = get_gpt_layer_local_spec().submodules.self_attention
            spec.submodules.core_attention = core
            mods.append(build_module(spec, config=cfg, layer_number=1))
        ref, sdpa = mods
        assert type(ref.core_attention) is DotProductAttention and type(sdpa.core_attention) is SDPACoreAttention
        torch.manual_seed(3)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * (0.15 if p.dim() > 1 else 0.1))
        sdpa.load_state_dict(ref.state_dict())
        x = torch.randn(S, b, hidden)
        dy = torch.randn(S, b, hidden)
        mask = None
        if c["mask"]:  # documents end at EOD tokens (id 0): a block-diagonal causal mask, True = masked
            tokens = torch.randint(1, 50, (S,))
            tokens[[5, 13]] = 0
            m, _, _ = _get_ltor_masks_and_position_ids(tokens, 0, True, True, False, True)
            mask = m.expand(b, 1, S, S)
            assert mask.any() and not mask[:, :, 6:, :6].logical_not().any()
        emb = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)(S)
        res = []
        for mod in (ref, sdpa):
            mod.train()
            model_parallel_cuda_manual_seed(1234)  # the tracker's dropout stream, reset for each module
            xi = x.clone().requires_grad_(True)
            y, bias = mod(xi, attention_mask=mask, rotary_pos_emb=emb)
            (y + bias).backward(dy)
            grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
            res.append((y + bias, xi.grad, grads, get_cuda_rng_tracker().get_states()["model-parallel-rng"]))
        (y0, dx0, g0, rng0), (y1, dx1, g1, rng1) = res
        def rel(a, b):  # max abs difference over the reference's max abs value
            return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()

        diffs = {"out": rel(y0, y1), "dx": rel(dx0, dx1)}
        diffs.update({f"d{n}": rel(g0[n], g1[n]) for n in g0})
        ref.eval()  # the same forward without dropout: how far dropout moved the output
        with torch.no_grad():
            y_eval, b_eval = ref(x, attention_mask=mask, rotary_pos_emb=emb)
        diffs_dropout = rel(y0, y_eval + b_eval)
        out[name] = {"diffs": diffs, "dropout_effect": diffs_dropout, "grads": sorted(g0), "same_rng_after": bool(torch.equal(rng0, rng1)),
                     "out_scale": y0.abs().max().item()}
    return out


def test_sdpa_matches_megatron_core_attention():
    res = run_distributed(_compare, 1, CASES, timeout=240)[0]
    for name, r in res.items():
        assert r["grads"] == ["linear_proj.bias", "linear_proj.weight", "linear_qkv.bias", "linear_qkv.weight"], name
        assert r["out_scale"] > 0.1, name  # a non-trivial output
        assert r["same_rng_after"], f"{name}: the modules drew different amounts of random numbers"
        worst = max(r["diffs"].values())
        assert (r["dropout_effect"] > 1e-2) == (CASES[name]["dropout"] > 0), (name, r["dropout_effect"])
        assert worst < TOL, f"{name}: {r['diffs']}"


@pytest.mark.parametrize("requested,cpu", [("auto", "flash"), ("flash", "flash"), ("fused", "fused"),
                                           ("unfused", "unfused"), ("local", "local")])
def test_platform_selects_the_core_attention(requested, cpu):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_weipipe.model.sdpa_attention import SDPACoreAttention, core_attention_class
    from megatron_weipipe.platform import Platform

    assert Platform("cpu", "gloo").attention_backend(requested) == cpu
    assert Platform("cuda", "nccl").attention_backend(requested) == cpu  # the same rule on a GPU host
    want = SDPACoreAttention if cpu in ("flash", "fused") else DotProductAttention
    assert core_attention_class(cpu) is want
