"""GPT / Llama-style models built from megatron-core layer specs."""

from __future__ import annotations

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


def build_transformer_config(cfg: PretrainConfig, num_layers: Optional[int] = None,
                             platform: Optional[Platform] = None) -> TransformerConfig:
    """megatron-core's TransformerConfig from our flags, for the layers ``platform`` builds.

    Transformer Engine layers get --attention-backend as megatron-core's ``attention_backend``
    (its LanguageModule maps it to TE's NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN,
    as Megatron-LM does); local layers choose their core attention in ``layer_spec`` and
    keep ``auto`` (all three left on). The fused masked softmax (megatron-core's unfused
    attention only) is on where its compiled kernels import, unless --no-masked-softmax-fusion.
    """
    from megatron.core.transformer.enums import AttnBackend

    from megatron_weipipe.model.sdpa_attention import requested_backend
    from megatron_weipipe.model.layer_choice import choose_layers

    m, p, t = cfg.model, cfg.parallel, cfg.training
    platform = platform or detect_platform()
    dtype = compute_dtype(cfg)
    on_gpu = platform.is_cuda
    te_layers = choose_layers(cfg, platform).transformer_engine
    kwargs = dict(
        num_layers=num_layers if num_layers is not None else m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        qk_layernorm=m.qk_layernorm,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        # Ulysses/FPDT (--cp-comm-type a2a) is applied around attention by this package, so
        # megatron-core sees CP 1; its own (TE attention, --cp-comm-type p2p ...) sees the size.
        context_parallel_size=p.context_parallel_size if p.megatron_context_parallel else 1,
        **_megatron_cp_kwargs(p),
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        use_cpu_initialization=m.use_cpu_initialization or not on_gpu,
        perform_initialization=True,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        recompute_modules=_recompute_modules(cfg),
        apply_rope_fusion=False,
        bias_activation_fusion=on_gpu and not m.swiglu and m.add_bias_linear,
        masked_softmax_fusion=platform.masked_softmax_fusion_available() and not cfg.megatron.no_masked_softmax_fusion,
        attention_backend=AttnBackend[requested_backend(cfg)] if te_layers else AttnBackend.auto,
        bias_dropout_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deterministic_mode=t.deterministic,
        # megatron-core's schedules then leave each microbatch's loss sum undivided and its DDP
        # sums over data-parallel ranks; training/step.py divides by the global token count.
        calculate_per_token_loss=t.calculate_per_token_loss,
        # gloo pairs sends to the same peer in posting order; unbatched p2p keeps flows apart.
        batch_p2p_comm=False,
        overlap_p2p_comm=p.overlap_p2p_comm,  # interleaved 1F1B only (ParallelConfig.resolved)
        # Transformer Engine's userbuffers (model/tp_overlap.py); megatron-core's local layers have none
        tp_comm_overlap=p.tp_comm_overlap and te_layers,
        **cfg.fp8.transformer_config_kwargs(),
    )
    if p.num_layers_per_virtual_pipeline_stage is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = p.virtual_pipeline_size(m.num_layers)
    if m.recompute_granularity == "full" and m.recompute_num_layers is None:
        kwargs["recompute_num_layers"] = 1
    return TransformerConfig(**kwargs)


def _megatron_cp_kwargs(p) -> dict:
    """megatron-core's --cp-comm-type (one value, or one per layer) for its own context parallelism."""
    if not p.megatron_context_parallel:
        return {}
    return dict(cp_comm_type=p.cp_comm_type[0] if len(p.cp_comm_type) == 1 else list(p.cp_comm_type))


def _recompute_modules(cfg: PretrainConfig) -> Optional[list[str]]:
    """megatron-core's recompute_modules: --recompute-modules (default core_attn) under selective
    recomputation, less ``mlp`` with FPDT, whose chunked MLP keeps only its input and recomputes
    its intermediate in backward already (a checkpoint around it would run it a third time)."""
    m = cfg.model
    if m.recompute_granularity != "selective":
        return None
    return [name for name in m.selective_modules if not (name == "mlp" and cfg.fpdt.enabled)]


def with_final_norm(spec, tconf: TransformerConfig, vp_stage: Optional[int]):
    """The decoder block of ``spec``'s layers with a zero-centred final norm where
    megatron-core's own (torch's norm) refuses one; else ``spec`` as it is."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_weipipe.model.norms import ZeroCenteredNorm

    if not (tconf.layernorm_zero_centered_gamma and isinstance(spec, ModuleSpec)
            and transformer_block.LayerNormImpl is WrappedTorchNorm):
        return spec
    layers = transformer_block.get_num_layers_to_build(tconf, vp_stage)
    return transformer_block.TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=ZeroCenteredNorm)


def layer_spec(cfg: PretrainConfig, platform: Optional[Platform] = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_weipipe.model.sdpa_attention import core_attention_class, requested_backend

    platform = platform or detect_platform()
    if use_transformer_engine(cfg, platform):
        # attention: build_transformer_config; TE's norms honour --apply-layernorm-1p themselves
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.model.qk_layernorm)
    from megatron_weipipe.model.norms import local_layer_spec

    spec = local_layer_spec(cfg)
    # --attention-backend, resolved by the platform: torch's fused SDPA unless unfused/local.
    backend = platform.attention_backend(requested_backend(cfg))
    spec.submodules.self_attention.submodules.core_attention = core_attention_class(backend, platform)
    return spec


def model_layer_spec(cfg: PretrainConfig, platform: Platform, long_context=None):
    """The layer spec ``build_gpt_model`` builds: Ulysses/FPDT's when ``long_context`` (its
    LongContextSettings) is given, else ``layer_spec``."""
    from megatron_weipipe.model.long_context import long_context_layer_spec

    if long_context is not None:
        return long_context_layer_spec(cfg, long_context, platform)
    return layer_spec(cfg, platform)


def build_gpt_model(
    cfg: PretrainConfig,
    vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int] = None,
    spec=None,
    platform: Optional[Platform] = None,
) -> GPTModel:
    """One pipeline stage (or virtual stage) of the GPT model, on this rank's device.
    ``platform`` (default: this host's) decides the layers, their kernels and the device."""
    from megatron_weipipe.model.long_context import (
        build_settings,
        chunk_final_norm,
        install_chunked_loss,
        uses_long_context,
    )
    from megatron_weipipe.model.init import core_initialization_skipped, reinitialize_layout_invariant

    m = cfg.model
    platform = platform or detect_platform()
    tconf = build_transformer_config(cfg, platform=platform)
    long_context = build_settings(cfg) if uses_long_context(cfg) else None
    if spec is None:
        spec = model_layer_spec(cfg, platform, long_context)
    # The layout-invariant init overwrites every parameter: megatron-core's draws are skipped.
    with core_initialization_skipped(tconf, enabled=m.layout_invariant_init):
        model = GPTModel(
            config=tconf,
            transformer_layer_spec=with_final_norm(spec, tconf, vp_stage),
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
    if platform.is_cuda:
        model.cuda(platform.current_device())
    dtype = compute_dtype(cfg)
    if dtype != torch.float32:
        # What Megatron-LM's Float16Module does: every floating tensor in the compute dtype
        # (megatron-core leaves e.g. learned position embeddings in fp32); the optimizer keeps
        # fp32 master weights.
        model.to(dtype=dtype)
    if m.layout_invariant_init:
        reinitialize_layout_invariant(model, cfg.training.seed, m.init_method_std, m.num_layers,
                                      zero_centered_norms=m.apply_layernorm_1p)
    if m.selective_modules:
        from megatron_weipipe.model import selective_recompute

        selective_recompute.install_norm_fix()
        selective_recompute.install_mlp_bias_fix(model)
    if m.offload_layer_inputs:
        from megatron_weipipe.model.layer_offload import LayerInputStore, install_on_block

        install_on_block(model.decoder, LayerInputStore(platform))
    if cfg.parallel.megatron_context_parallel:
        from megatron_weipipe.model.megatron_cp import MegatronContextParallel

        model.long_context = MegatronContextParallel.from_parallel_state()  # the forward step shards batches
    if long_context is not None:
        model.long_context = long_context  # read by the forward step to shard batches
        if long_context.fpdt is not None:
            install_chunked_loss(model, long_context.fpdt.loss_num_chunks(m.seq_length), long_context.tp_group)
            chunk_final_norm(model, long_context.num_chunks)
    return model

