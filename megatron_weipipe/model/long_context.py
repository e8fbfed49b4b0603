"""Ulysses / FPDT inside megatron-core's GPTModel, keeping megatron-core's parameters.

The attention and MLP modules stay megatron-core's own (ColumnParallelLinear /
RowParallelLinear with their TP attributes and sharded-state-dict keys), so checkpoints,
gradient-norm bookkeeping and layout-invariant initialisation work unchanged; only their
forward is replaced by the chunked kernels of ``megatron_weipipe.fpdt``. With FPDT the
output layer + cross-entropy is chunked too, so [s, V] logits never exist.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP

from megatron_weipipe import mcore_versions
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.fpdt import (
    FPDTConfig,
    RotaryConfig,
    attention_spec_from_megatron,
    chunked_cross_entropy,
    chunked_mlp,
    fpdt_attention,
    shard_batch,
    ulysses_attention,
)
from megatron_weipipe.fpdt.chunked import chunk_forward, sequence_chunked_module
from megatron_weipipe.fpdt.documents import document_offsets
from megatron_weipipe.fpdt.offload import HostBufferPool, OffloadStats


@dataclass
class LongContextSettings:
    """What the forward step needs to shard a batch and reduce the loss over the CP group."""

    cp_group: torch.distributed.ProcessGroup
    tp_group: Optional[torch.distributed.ProcessGroup]
    cp_size: int
    cp_rank: int
    num_chunks: int  # u: FPDT chunks (1 for plain Ulysses)
    fpdt: Optional[FPDTConfig]
    eod_token: Optional[int] = None  # --reset-attention-mask: documents end after this token
    # --fpdt-offload: the one HostBufferPool (and side copy stream) of every attention
    # module of this model, made on the first offloaded call (pinned on CUDA). Each
    # forward/backward pair gives its buffers back only after their last use, so layers
    # take turns with the same buffers: under full recomputation the pool holds one
    # layer's set, without it the largest set live at once (simulator/memory.py
    # shared_pool_bytes).
    host_pool: Optional[HostBufferPool] = None

    def shared_pool(self, device_is_cuda: bool) -> HostBufferPool:
        if self.host_pool is None:
            self.host_pool = HostBufferPool(pin_memory=device_is_cuda)
        return self.host_pool


def uses_long_context(cfg: PretrainConfig) -> bool:
    return cfg.parallel.context_parallel_size > 1 or cfg.fpdt.enabled


def build_settings(cfg: PretrainConfig) -> LongContextSettings:
    from megatron.core import parallel_state as ps

    fc = cfg.fpdt if cfg.fpdt.enabled else None
    eod = None
    if cfg.data.reset_attention_mask:
        from megatron_weipipe.data.tokenizers import build_tokenizer

        eod = build_tokenizer(cfg.data).eod
    return LongContextSettings(
        cp_group=ps.get_context_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group() if cfg.parallel.tensor_model_parallel_size > 1 else None,
        cp_size=cfg.parallel.context_parallel_size,
        cp_rank=ps.get_context_parallel_rank(),
        num_chunks=fc.num_chunks(cfg.model.seq_length) if fc is not None else 1,
        fpdt=fc,
        eod_token=eod,
    )


def _rotary(cfg: PretrainConfig) -> Optional[RotaryConfig]:
    if cfg.model.position_embedding_type != "rope":
        return None
    return RotaryConfig(base=cfg.model.rotary_base, percent=cfg.model.rotary_percent,
                        rope_scaling=cfg.model.use_rope_scaling, rope_scaling_factor=cfg.model.rope_scaling_factor)


def long_context_layer_spec(cfg: PretrainConfig, settings: LongContextSettings, platform=None):
    """megatron-core's local GPT layer spec with Ulysses/FPDT attention and (FPDT) chunked MLP and norms.

    The attention runs fpdt's block kernels (flash on a GPU for fp16/bf16, fpdt/kernels.py);
    the core-attention submodule it still builds (never called) is the platform's, as on
    the plain local spec, so no layer of the model is megatron-core's unfused attention."""
    from megatron_weipipe.model.norms import local_layer_spec
    from megatron_weipipe.model.sdpa_attention import core_attention_class, requested_backend
    from megatron_weipipe.platform import detect_platform

    platform = platform or detect_platform()
    spec = local_layer_spec(cfg)
    attention_spec = spec.submodules.self_attention
    attention_spec.module = _attention_class(settings, _rotary(cfg))
    attention_spec.submodules.core_attention = core_attention_class(
        platform.attention_backend(requested_backend(cfg)), platform)
    if settings.fpdt is not None:
        from megatron.core import parallel_state as ps

        activation = "swiglu" if cfg.model.swiglu else "gelu"
        mlp_class = _mlp_class(settings.fpdt.mlp_num_chunks(cfg.model.seq_length), activation, settings.tp_group)
        spec.submodules.mlp = mcore_versions.with_mlp_class(spec.submodules.mlp, mlp_class,
                                                            ps.get_tensor_model_parallel_group())
        logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
            lambda record: "Unknown MLP type" not in record.getMessage()
        )
        # the norms too: with them the whole layer runs in sequence chunks. Not in a WeiPipe
        # ring: its runtime binds each chunk's circulating weights to the modules per action,
        # and a norm recomputed at backward time would read (and send its gradient to) the
        # weights bound then
        for name in ("input_layernorm", "pre_mlp_layernorm") if chunk_norms(cfg) else ():
            norm = getattr(spec.submodules, name)
            if norm is not IdentityOp:
                setattr(spec.submodules, name, sequence_chunked_module(norm, settings.num_chunks))
    return spec


def chunk_norms(cfg: PretrainConfig) -> bool:
    """Whether FPDT runs the layers' norms in sequence chunks (every schedule but WeiPipe's;
    the final norm is chunked under every schedule, ``chunk_final_norm``)."""
    return cfg.fpdt.enabled and not (cfg.parallel.pipeline_schedule or "").startswith("weipipe")


def _attention_class(settings: LongContextSettings, rotary: Optional[RotaryConfig]):
    class LongContextSelfAttention(SelfAttention):
        """SelfAttention whose forward is Ulysses (one chunk) or FPDT (several) over the CP group."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            tp = 1 if settings.tp_group is None else torch.distributed.get_world_size(settings.tp_group)
            self.spec = attention_spec_from_megatron(config, tp, rotary=rotary)
            self.spec.validate(settings.cp_size)
            self.offload_stats = OffloadStats()

        def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **unused):
            # Positions come from the layout (global RoPE positions per chunk), not rotary_pos_emb.
            # attention_mask is None (causal) or the packed documents' offsets [b, n+1]
            # (shard_for_context_parallel), never a dense mask.
            qkv_bias = self.linear_qkv.bias
            if settings.fpdt is None:
                out = ulysses_attention(
                    hidden_states, self.linear_qkv.weight, qkv_bias, self.linear_proj.weight, None,
                    self.spec, settings.cp_group, settings.tp_group, documents=attention_mask,
                    recompute=self._core_recompute(),
                )
            else:
                pool = settings.shared_pool(hidden_states.is_cuda) if settings.fpdt.offload else None
                out = fpdt_attention(
                    hidden_states, self.linear_qkv.weight, qkv_bias, self.linear_proj.weight, None,
                    self.spec, settings.fpdt, settings.cp_group, settings.tp_group,
                    pool=pool, stats=self.offload_stats, num_chunks=settings.num_chunks,
                    documents=attention_mask,
                )
            return out, self.linear_proj.bias

        def _core_recompute(self):
            """--recompute-modules core_attn (megatron-core's flag on this module): its
            checkpoint, looked up per call (WeiPipe's chunk forwards replace it)."""
            if not (self.checkpoint_core_attention and self.training and torch.is_grad_enabled()):
                return None
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint

        @property
        def pool(self) -> Optional[HostBufferPool]:
            """The model's shared host pool (None until the first offloaded call)."""
            return settings.host_pool

    return LongContextSelfAttention


def _mlp_class(num_chunks: int, activation: str, tp_group):
    class ChunkedSequenceMLP(MLP):
        """megatron-core's MLP run in sequence chunks, recomputing the wide intermediate."""

        def forward(self, hidden_states, *args, **kwargs):
            out = chunked_mlp(
                hidden_states, self.linear_fc1.weight, self.linear_fc1.bias, self.linear_fc2.weight, None,
                activation, num_chunks, tp_group,
            )
            return out, self.linear_fc2.bias

    return ChunkedSequenceMLP


class _DeferredLogits:
    """Stands in for logits: the hidden states and output weight, for a chunked loss."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        self.hidden, self.weight = hidden, weight


def install_chunked_loss(model, num_chunks: int, tp_group) -> None:
    """Make ``model(..., labels=...)`` compute the loss in sequence chunks (FPDT).

    GPTModel builds [s, b, V] logits before the loss; here the output layer hands back its
    input and weight instead, and the loss runs chunked_cross_entropy over them. Calls
    without labels (inference) still get real logits. ``model.chunked_loss(hidden, weight,
    labels)`` is the same loss for callers that run the head themselves (WeiPipe's ring
    model, schedules/gpt/weipipe/steps.py).
    """
    if not getattr(model, "post_process", False):
        return
    model.chunked_loss = functools.partial(chunked_cross_entropy, num_chunks=num_chunks, tp_group=tp_group)
    output_layer = model.output_layer
    plain_output = output_layer.forward
    plain_model_forward = model.forward
    state = {"labels": False}

    def output_forward(input_, weight=None, runtime_gather_output=None):
        if state["labels"]:
            return _DeferredLogits(input_, weight if weight is not None else output_layer.weight), None
        return plain_output(input_, weight=weight, runtime_gather_output=runtime_gather_output)

    def loss(labels, logits):
        if isinstance(logits, _DeferredLogits):
            return model.chunked_loss(logits.hidden, logits.weight, labels)
        return type(model).compute_language_model_loss(model, labels, logits)

    def model_forward(*args, **kwargs):
        state["labels"] = kwargs.get("labels") is not None
        try:
            return plain_model_forward(*args, **kwargs)
        finally:
            state["labels"] = False

    model_forward.__signature__ = inspect.signature(plain_model_forward)  # callers bind arguments by name
    output_layer.forward = output_forward
    model.compute_language_model_loss = loss
    model.forward = model_forward


def chunk_final_norm(model, num_chunks: int) -> None:
    """The decoder's final norm in sequence chunks too (FPDT), like the layers' norms. In
    WeiPipe rings as well: the final norm is replicated on every ring rank, never rebound
    to circulating weights, so its backward-time recomputation reads its own weights."""
    norm = getattr(getattr(model, "decoder", None), "final_layernorm", None)
    if norm is not None and not isinstance(norm, IdentityOp):
        chunk_forward(norm, num_chunks)


def shard_for_context_parallel(batch: dict, settings: LongContextSettings) -> dict:
    """This CP rank's tokens (FPDT layout; contiguous for one chunk), positions kept global.

    With --reset-attention-mask the attention mask becomes the documents' cumulative
    offsets [b, n+1], found from the EOD tokens of the whole sample before it is split:
    every CP rank reads the whole micro-batch, so each computes the same global
    boundaries and none travel between ranks. They stay on the CPU (block decisions are
    made on the host)."""
    if "position_ids" not in batch or batch["position_ids"] is None:
        b, s = batch["tokens"].shape
        batch = dict(batch, position_ids=torch.arange(s).unsqueeze(0).expand(b, s))
    if batch.get("attention_mask") is not None:
        raise ValueError("Ulysses/FPDT batches must not carry a dense attention mask (create_attention_mask is off)")
    if settings.eod_token is not None:
        batch = dict(batch, attention_mask=document_offsets(batch["tokens"], settings.eod_token))
    return shard_batch(batch, settings.cp_size, settings.cp_rank, settings.num_chunks)
