"""The FPDT blocks take megatron-core's own parameters unchanged.

megatron-core's SelfAttention and MLP (local spec, CPU adapter) are built at TP=2; their
TP-local weights are handed to fpdt_attention / chunked_mlp / FPDTSelfAttention as they
are, and outputs and input gradients must agree in float32. The vocab-parallel loss is
checked against megatron-core's vocab_parallel_cross_entropy the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_distributed

TOL = 2e-5


def _megatron_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_weipipe.fpdt import (
        AttentionSpec,
        FPDTConfig,
        RotaryConfig,
        attention_spec_from_megatron,
        chunked_cross_entropy,
        chunked_mlp,
        fpdt_attention,
    )
    from megatron_weipipe import mcore_versions
    from megatron_weipipe.platform import install_cpu_adapter

    from fpdt_modules import FPDTSelfAttention

    install_cpu_adapter()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    tp = parallel_state.get_tensor_model_parallel_group()
    S, b, hidden, heads, groups, d = 16, 2, 32, 4, 2, 8
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=48,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=world,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    layer_spec = get_gpt_layer_local_spec()
    attn = build_module(layer_spec.submodules.self_attention, config=cfg, layer_number=1)
    mlp = mcore_versions.build_layer_mlp(layer_spec.submodules.mlp, cfg)
    torch.manual_seed(7)  # same data on both TP ranks
    with torch.no_grad():  # non-trivial biases (megatron initialises them to zero)
        for p in list(attn.parameters()) + list(mlp.parameters()):
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
    x = torch.randn(S, b, hidden)
    dy = torch.randn(S, b, hidden)
    rot = RotaryConfig(base=10000.0, percent=1.0)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    emb = rope(S)
    res = {}

    # --- attention: megatron SelfAttention vs fpdt_attention on the same TP-local weights
    xm = x.clone().requires_grad_(True)
    out_m, bias_m = attn(xm, attention_mask=None, rotary_pos_emb=emb)
    (out_m + bias_m).backward(dy)
    spec = attention_spec_from_megatron(cfg, world, rotary=rot)
    assert spec == AttentionSpec(hidden, heads // world, d, groups // world, rotary=rot)
    xf = x.clone().requires_grad_(True)
    out_f = fpdt_attention(
        xf, attn.linear_qkv.weight, attn.linear_qkv.bias, attn.linear_proj.weight, attn.linear_proj.bias,
        spec, FPDTConfig(chunk_size=4, offload=True), None, tp,
    )
    out_f.backward(dy)
    res["attn_out"] = (out_f - (out_m + bias_m)).abs().max().item()
    res["attn_dx"] = (xf.grad - xm.grad).abs().max().item()

    # --- the module loads megatron's state dict as is (same keys, same shapes)
    mod = FPDTSelfAttention(spec, FPDTConfig(chunk_size=8), tp_group=tp)
    sd = {k: v for k, v in attn.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = mod.load_state_dict(sd, strict=False)
    res["keys"] = (sorted(missing), sorted(unexpected))
    out_mod, bias_mod = mod(x, attention_mask=None, rotary_pos_emb=emb)
    res["module_out"] = (out_mod + bias_mod - (out_m + bias_m)).abs().max().item()

    # --- MLP (SwiGLU, [gate | up] fc1 layout) vs chunked_mlp
    xm = x.clone().requires_grad_(True)
    o, ob = mlp(xm)
    (o + ob).backward(dy)
    xf = x.clone().requires_grad_(True)
    of = chunked_mlp(
        xf, mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias,
        "swiglu", num_chunks=4, tp_group=tp,
    )
    of.backward(dy)
    res["mlp_out"] = (of - (o + ob)).abs().max().item()
    res["mlp_dx"] = (xf.grad - xm.grad).abs().max().item()

    # --- vocab-parallel loss vs megatron's vocab_parallel_cross_entropy on full local logits
    V_local = 24
    w = torch.randn(V_local, hidden) * 0.3
    labels = torch.randint(0, V_local * world, (b, S), generator=torch.Generator().manual_seed(3))
    hm = x.clone().requires_grad_(True)
    logits = torch.matmul(hm, w.t())
    loss_m = vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()
    loss_m.backward(torch.ones_like(loss_m))
    dist.all_reduce(hm.grad, group=tp)  # the output layer's input gradient is summed over TP
    hf = x.clone().requires_grad_(True)
    loss_f = chunked_cross_entropy(hf, w, labels, num_chunks=4, tp_group=tp)
    loss_f.backward(torch.ones_like(loss_f))
    res["loss"] = (loss_f - loss_m).abs().max().item()
    res["loss_dx"] = (hf.grad - hm.grad).abs().max().item()
    parallel_state.destroy_model_parallel()
    return res


def test_megatron_parameters_load_unchanged():
    per_rank = run_distributed(_megatron_run, 2, timeout=240)
    for rank, res in enumerate(per_rank):
        assert res["keys"] == ([], []), res["keys"]
        for name in ("attn_out", "attn_dx", "module_out", "mlp_out", "mlp_dx", "loss", "loss_dx"):
            assert res[name] <= TOL, f"rank {rank}: {name} differs from megatron-core by {res[name]:.2e}"
