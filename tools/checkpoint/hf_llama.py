"""Hugging Face Llama-family configs and tensors <-> this package's flags and megatron-core names.

Pure functions (torch only): the CLI in convert.py reads and writes the files. Layout
facts used here: megatron-core keeps Q, K and V in one ``linear_qkv`` weight, grouped per
key/value head as [q heads of the group, k, v]; the SwiGLU ``linear_fc1`` is [gate; up];
Hugging Face's q/k rows are already in the rotate-half order megatron-core's RoPE uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class ConversionError(ValueError):
    """One line naming the config field or tensor that does not fit."""


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    tied: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope_scaling_factor: Optional[float] = None  # Llama-3.1 scaling when set
    model_type: str = "llama"
    # --apply-layernorm-1p: megatron-core keeps each norm weight as (Hugging Face's weight - 1)
    zero_centered_norms: bool = False


def _rope(config: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from either form: transformers 5.x ``rope_parameters``
    or 4.x ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    if params is not None:
        if "rope_type" not in params and len(params) == 1 and isinstance(next(iter(params.values())), dict):
            params = next(iter(params.values()))  # one entry per attention type
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if kind == "default" else dict(params, rope_type=kind))
    scaling = config.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling, rope_type=scaling.get("rope_type", scaling.get("type", "default")))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(config.get("rope_theta", 10000.0)), scaling


def shape_from_hf(config: dict) -> LlamaShape:
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ConversionError(f"config.json model_type {model_type!r}: only llama, mistral and qwen2 convert")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) converts")
    if config.get("mlp_bias"):
        raise ConversionError("config.json mlp_bias: true has no megatron-core counterpart here")
    if model_type != "qwen2" and config.get("attention_bias"):
        raise ConversionError("config.json attention_bias: true also biases o_proj, which megatron-core's "
                              "--add-qkv-bias does not; only Q/K/V biases (Qwen2-style) convert")
    if config.get("sliding_window") and config.get("use_sliding_window", model_type == "mistral"):
        raise ConversionError("config.json sliding_window: sliding-window attention is not supported")
    theta, scaling = _rope(config)
    factor = None
    if scaling is not None:
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if scaling["rope_type"] != "llama3" or any(float(scaling.get(k, v)) != v for k, v in want.items()):
            raise ConversionError(f"config.json RoPE scaling {scaling}: only llama3 scaling with low/high frequency "
                                  f"factors 1 and 4 and original context 8192 (megatron-core's) converts")
        factor = float(scaling["factor"])
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta {theta}: --rotary-base takes an integer")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return LlamaShape(
        num_layers=config["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=config["intermediate_size"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads, vocab_size=config["vocab_size"], rope_theta=theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2", max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_scaling_factor=factor, model_type=model_type,
    )


def vocab_divisor(vocab_size: int, tp: int) -> Optional[int]:
    """A --make-vocab-size-divisible-by that pads ``vocab_size`` by nothing at TP=``tp``: the
    largest divisor of vocab/TP up to Megatron's 128; None if TP does not divide the vocabulary."""
    if vocab_size % tp:
        return None
    per_rank = vocab_size // tp
    return max(d for d in range(1, min(128, per_rank) + 1) if per_rank % d == 0)


def model_flags(s: LlamaShape, tp: int = 1) -> list[str]:
    """pretrain_gpt.py's model flags for this shape (the vocabulary divisor for TP=``tp``)."""
    divisor = vocab_divisor(s.vocab_size, tp)
    if divisor is None:
        raise ConversionError(f"vocab_size {s.vocab_size} is not divisible by --tensor-model-parallel-size {tp}: "
                              f"no --make-vocab-size-divisible-by avoids padded logits")
    flags = ["--num-layers", s.num_layers, "--hidden-size", s.hidden_size, "--ffn-hidden-size", s.ffn_hidden_size,
             "--num-attention-heads", s.num_heads, "--group-query-attention", "--num-query-groups", s.num_kv_heads,
             "--kv-channels", s.head_dim, "--position-embedding-type", "rope", "--rotary-base", int(s.rope_theta),
             "--normalization", "RMSNorm", "--norm-epsilon", s.norm_eps, "--swiglu", "--disable-bias-linear",
             "--max-position-embeddings", s.max_position_embeddings, "--make-vocab-size-divisible-by", divisor]
    if s.qkv_bias:
        flags.append("--add-qkv-bias")
    if not s.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if s.rope_scaling_factor is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", s.rope_scaling_factor]
    if s.zero_centered_norms:
        flags.append("--apply-layernorm-1p")
    return [str(f) for f in flags]


def _get(tensors: dict, name: str, shape: tuple) -> torch.Tensor:
    if name not in tensors:
        raise ConversionError(f"tensor {name} is missing from the Hugging Face checkpoint")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise ConversionError(f"tensor {name} has shape {tuple(t.shape)}, the config gives {tuple(shape)}")
    return t


def _shifted(t: torch.Tensor, by: float) -> torch.Tensor:
    """A norm weight between Hugging Face's form and the zero-centred one (by = -1 or +1; 0: as is)."""
    return t + by if by else t


def hf_to_mcore(s: LlamaShape, tensors: dict, padded_vocab: int) -> dict:
    """megatron-core GPTModel state dict (local layer spec) from Hugging Face tensors."""
    h, d, nq, nkv, f = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, s.ffn_hidden_size
    if nq % nkv:
        raise ConversionError(f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
    out = {}
    shift = 1.0 if s.zero_centered_norms else 0.0

    def norm(name):
        return _shifted(_get(tensors, name, (h,)), -shift)

    def pad(t):
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])]) if padded_vocab > t.shape[0] else t

    out["embedding.word_embeddings.weight"] = pad(_get(tensors, "model.embed_tokens.weight", (s.vocab_size, h)))
    for i in range(s.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = _get(tensors, hf + "self_attn.q_proj.weight", (nq * d, h))
        k = _get(tensors, hf + "self_attn.k_proj.weight", (nkv * d, h))
        v = _get(tensors, hf + "self_attn.v_proj.weight", (nkv * d, h))
        out[mc + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.reshape(nkv, nq // nkv * d, h), k.reshape(nkv, d, h), v.reshape(nkv, d, h)], dim=1).reshape(-1, h)
        if s.qkv_bias:
            qb = _get(tensors, hf + "self_attn.q_proj.bias", (nq * d,))
            kb = _get(tensors, hf + "self_attn.k_proj.bias", (nkv * d,))
            vb = _get(tensors, hf + "self_attn.v_proj.bias", (nkv * d,))
            out[mc + "self_attention.linear_qkv.bias"] = torch.cat(
                [qb.reshape(nkv, -1), kb.reshape(nkv, d), vb.reshape(nkv, d)], dim=1).reshape(-1)
        out[mc + "self_attention.linear_proj.weight"] = _get(tensors, hf + "self_attn.o_proj.weight", (h, nq * d))
        out[mc + "input_layernorm.weight"] = norm(hf + "input_layernorm.weight")
        out[mc + "pre_mlp_layernorm.weight"] = norm(hf + "post_attention_layernorm.weight")
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [_get(tensors, hf + "mlp.gate_proj.weight", (f, h)), _get(tensors, hf + "mlp.up_proj.weight", (f, h))])
        out[mc + "mlp.linear_fc2.weight"] = _get(tensors, hf + "mlp.down_proj.weight", (h, f))
    out["decoder.final_layernorm.weight"] = norm("model.norm.weight")
    if not s.tied:
        out["output_layer.weight"] = pad(_get(tensors, "lm_head.weight", (s.vocab_size, h)))
    return out


def mcore_to_hf(s: LlamaShape, state: dict) -> dict:
    """Hugging Face tensors from a megatron-core GPTModel state dict (inverse of hf_to_mcore)."""
    h, d, nq, nkv, f, vocab = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, s.ffn_hidden_size, s.vocab_size
    per = nq // nkv * d
    shift = 1.0 if s.zero_centered_norms else 0.0
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab]}
    for i in range(s.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[mc + "self_attention.linear_qkv.weight"].reshape(nkv, per + 2 * d, h)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(nq * d, h)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, per:per + d].reshape(nkv * d, h)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, per + d:].reshape(nkv * d, h)
        if s.qkv_bias:
            b = state[mc + "self_attention.linear_qkv.bias"].reshape(nkv, per + 2 * d)
            out[hf + "self_attn.q_proj.bias"] = b[:, :per].reshape(-1)
            out[hf + "self_attn.k_proj.bias"] = b[:, per:per + d].reshape(-1)
            out[hf + "self_attn.v_proj.bias"] = b[:, per + d:].reshape(-1)
        out[hf + "self_attn.o_proj.weight"] = state[mc + "self_attention.linear_proj.weight"]
        out[hf + "input_layernorm.weight"] = _shifted(state[mc + "input_layernorm.weight"], shift)
        out[hf + "post_attention_layernorm.weight"] = _shifted(state[mc + "pre_mlp_layernorm.weight"], shift)
        fc1 = state[mc + "mlp.linear_fc1.weight"]
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
        out[hf + "mlp.down_proj.weight"] = state[mc + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = _shifted(state["decoder.final_layernorm.weight"], shift)
    if not s.tied:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_config(s: LlamaShape, dtype: str = "float32") -> dict:
    """config.json for ``s`` in the form both transformers 4.x and 5.x read."""
    config = {
        "architectures": ["Qwen2ForCausalLM" if s.model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if s.model_type == "qwen2" else "llama",
        "hidden_size": s.hidden_size, "intermediate_size": s.ffn_hidden_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "vocab_size": s.vocab_size, "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings, "tie_word_embeddings": s.tied,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }
    if s.rope_scaling_factor is not None:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.rope_scaling_factor, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return config


def shape_from_flags(flags: list[str], vocab_size: int) -> LlamaShape:
    """The LlamaShape of a checkpoint from its saved model flags."""
    def value(name, default=None):
        return flags[flags.index(name) + 1] if name in flags else default

    hidden, heads = int(value("--hidden-size")), int(value("--num-attention-heads"))
    if "--swiglu" not in flags or value("--normalization") != "RMSNorm" or value("--position-embedding-type") != "rope":
        raise ConversionError("the checkpoint is not Llama-style (needs --swiglu, --normalization RMSNorm and "
                              "--position-embedding-type rope)")
    if "--disable-bias-linear" not in flags:
        raise ConversionError("the checkpoint has linear biases (no --disable-bias-linear): not a Llama layout")
    if "--qk-layernorm" in flags:
        raise ConversionError("the checkpoint has query/key norms (--qk-layernorm): Llama checkpoints have none")
    scaling = "--use-rope-scaling" in flags
    return LlamaShape(
        num_layers=int(value("--num-layers")), hidden_size=hidden, ffn_hidden_size=int(value("--ffn-hidden-size")),
        num_heads=heads, num_kv_heads=int(value("--num-query-groups", heads)),
        head_dim=int(value("--kv-channels", hidden // heads)), vocab_size=vocab_size,
        rope_theta=float(value("--rotary-base", 10000)), norm_eps=float(value("--norm-epsilon", 1e-5)),
        tied="--untie-embeddings-and-output-weights" not in flags, qkv_bias="--add-qkv-bias" in flags,
        max_position_embeddings=int(value("--max-position-embeddings", value("--seq-length", 4096))),
        rope_scaling_factor=float(value("--rope-scaling-factor", 8.0)) if scaling else None,
        model_type="qwen2" if "--add-qkv-bias" in flags else "llama",
        zero_centered_norms="--apply-layernorm-1p" in flags,
    )

