"""GPT / Llama-style models built from megatron-core layer specs."""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.platform import Platform, detect_platform


def use_transformer_engine(cfg: PretrainConfig, platform: Optional[Platform] = None) -> bool:
    """Whether this run builds TE layers (model/layer_choice.py decides; its notices are logged)."""
    from megatron_weipipe.model.layer_choice import announce, choose_layers

    choice = choose_layers(cfg, platform or detect_platform())
    announce(choice)
    return choice.transformer_engine


def compute_dtype(cfg: PretrainConfig) -> torch.dtype:
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def build_transformer_config(cfg: PretrainConfig, num_layers: Optional[int] = None) -> TransformerConfig:
    """megatron-core's TransformerConfig from our flags."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    dtype = compute_dtype(cfg)
    on_gpu = detect_platform().is_cuda
    kwargs = dict(
        num_layers=num_layers if num_layers is not None else m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        # Context parallelism here is Ulysses/FPDT, applied around attention by this package;
        # megatron-core's own (ring attention through TE) stays off.
        context_parallel_size=1,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        apply_rope_fusion=False,
        bias_activation_fusion=on_gpu and not m.swiglu and m.add_bias_linear,
        masked_softmax_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deterministic_mode=t.deterministic,
        # gloo pairs sends to the same peer in posting order; unbatched p2p keeps flows apart.
        batch_p2p_comm=False,
    )
    if p.num_layers_per_virtual_pipeline_stage is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = p.virtual_pipeline_size(m.num_layers)
    if m.recompute_granularity == "full" and m.recompute_num_layers is None:
        kwargs["recompute_num_layers"] = 1
    return TransformerConfig(**kwargs)


def layer_spec(cfg: PretrainConfig, platform: Optional[Platform] = None):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_weipipe.model.attention import core_attention_class

    platform = platform or detect_platform()
    if use_transformer_engine(cfg, platform):
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    # --attention-backend, resolved by the platform (CPU: torch's fused SDPA unless unfused/local).
    backend = platform.attention_backend(cfg.model.attention_backend)
    spec.submodules.self_attention.submodules.core_attention = core_attention_class(backend)
    return spec


def build_gpt_model(
    cfg: PretrainConfig,
    vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int] = None,
    spec=None,
) -> GPTModel:
    """One pipeline stage (or virtual stage) of the GPT model, on this rank's device."""
    from megatron_weipipe.model.long_context import (
        build_settings,
        chunk_final_norm,
        chunk_norms,
        install_chunked_loss,
        long_context_layer_spec,
        uses_long_context,
    )

    m = cfg.model
    tconf = build_transformer_config(cfg)
    long_context = build_settings(cfg) if uses_long_context(cfg) else None
    if spec is None:
        spec = long_context_layer_spec(cfg, long_context) if long_context is not None else layer_spec(cfg)
    model = GPTModel(
        config=tconf,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        vp_stage=vp_stage,
    )
    platform = detect_platform()
    if platform.is_cuda:
        model.cuda(platform.current_device())
    dtype = compute_dtype(cfg)
    if dtype != torch.float32:
        # What Megatron-LM's Float16Module does: every floating tensor in the compute dtype
        # (megatron-core leaves e.g. learned position embeddings in fp32); the optimizer keeps
        # fp32 master weights.
        model.to(dtype=dtype)
    if m.layout_invariant_init:
        reinitialize_layout_invariant(model, cfg)
    if m.offload_layer_inputs:
        from megatron_weipipe.model.layer_offload import LayerInputStore, install_on_block

        install_on_block(model.decoder, LayerInputStore(platform))
    if long_context is not None:
        model.long_context = long_context  # read by the forward step to shard batches
        if long_context.fpdt is not None:
            install_chunked_loss(model, long_context.fpdt.loss_num_chunks(m.seq_length), long_context.tp_group)
            if chunk_norms(cfg):
                chunk_final_norm(model, long_context.num_chunks)
    return model


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_kind(key: str) -> str:
    """How megatron-core initialises the tensor behind a sharded-state-dict key."""
    leaf = key.rsplit(".", 1)[-1]
    if "layernorm" in key or "layer_norm" in key or key.endswith("norm.weight"):
        return "ones" if leaf == "weight" else "zeros"
    if leaf == "bias":
        return "zeros"
    if "linear_proj" in key or "linear_fc2" in key:
        return "scaled_normal"
    return "normal"


@torch.no_grad()
def reinitialize_layout_invariant(model: torch.nn.Module, cfg: PretrainConfig) -> None:
    """Re-draw every parameter from a generator seeded by (seed, checkpoint key).

    megatron-core's initialisation depends on how layers are spread over ranks, so the
    same seed gives a different model at PP=2 than at PP=1. Drawing each global tensor
    from its own key-seeded generator and keeping this rank's shard makes the model
    identical under every TP/PP/VPP/WeiPipe layout, so runs under different schedules
    can be compared and switched.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    std = cfg.model.init_method_std
    scaled_std = std / math.sqrt(2.0 * cfg.model.num_layers)
    done = set()
    for _, sh in _flatten(model.sharded_state_dict()):
        if not isinstance(sh, ShardedTensor) or not isinstance(sh.data, torch.Tensor):
            continue
        if id(sh.data) in done or not sh.data.is_floating_point():
            continue
        done.add(id(sh.data))
        local = sh.data
        kind = _init_kind(sh.key)
        if kind == "ones":
            local.fill_(1.0)
            continue
        if kind == "zeros":
            local.zero_()
            continue
        # Stacked layers carry their layer index as leading "prepended" axes.
        n = sh.prepend_axis_num
        layer_coords = tuple(sh.global_offset[:n])
        shape, offsets = sh.global_shape[n:], sh.global_offset[n:]
        gen = torch.Generator().manual_seed(_key_seed(cfg.training.seed, f"{sh.key}@{layer_coords}"))
        full = torch.empty(shape, dtype=torch.float32)
        full.normal_(0.0, scaled_std if kind == "scaled_normal" else std, generator=gen)
        local_shape = sh.local_shape[-len(shape):] if shape else ()
        index = tuple(slice(o, o + size) for o, size in zip(offsets, local_shape))
        local.copy_(full[index].reshape(local.shape).to(local.dtype))


def _flatten(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], d
