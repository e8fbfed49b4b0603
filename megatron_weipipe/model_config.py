"""The model's flags: shape, layers, attention, recomputation and initialisation.

Part of the typed run configuration (megatron_weipipe/config.py composes it into
``PretrainConfig``); plain Python, like the rest of the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option
from megatron_weipipe.shape import ModelShape, ffn_hidden_size

# Megatron-LM's --attention-backend values (model/sdpa_attention.py, model/gpt.py and
# platform.py say which core attention each selects).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# megatron-core's TransformerConfig.recompute_modules: the dense layers this package builds
# recompute these three; the rest belong to layers it never builds (MoE, MLA, GatedDelta, mHC).
SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm")
NOT_BUILT_MODULES = {"moe_act": "mixture-of-experts", "moe": "mixture-of-experts",
                     "shared_experts": "mixture-of-experts", "mla_up_proj": "multi-latent attention",
                     "gdn_norm_out": "GatedDeltaNet", "gdp_in_proj": "GatedDeltaProduct",
                     "gdp_qkv": "GatedDeltaProduct", "mhc": "mHC"}


@dataclass
class ModelConfig:
    num_layers: int = option(2, required=True, help="number of transformer layers")
    hidden_size: int = option(64, required=True, help="transformer hidden size")
    num_attention_heads: int = option(4, required=True, help="number of attention heads")
    ffn_hidden_size: Optional[int] = option(
        None, help="MLP width (default: 4 x hidden, or int(4h x 2/3 / 64) x 64 with --swiglu, as Megatron-LM)")
    num_query_groups: Optional[int] = option(None, help="key/value heads for grouped-query attention")
    group_query_attention: bool = option(False, help="grouped-query attention (with --num-query-groups)")
    kv_channels: Optional[int] = option(None, help="head dimension (default: hidden / heads)")
    seq_length: int = option(128, required=True, help="tokens per sample")
    max_position_embeddings: Optional[int] = option(
        None, help="size of the learned position table (default: --seq-length)")
    position_embedding_type: str = option("learned_absolute", help="learned_absolute, rope or none")
    rotary_base: int = option(10000, help="RoPE base")
    rotary_percent: float = option(1.0, help="fraction of each head's channels that RoPE rotates")
    use_rope_scaling: bool = option(False, help="Llama-3.1 RoPE frequency scaling (low/high frequency factors 1 "
                                                "and 4, original context 8192, as megatron-core applies it)")
    rope_scaling_factor: float = option(8.0, help="factor of --use-rope-scaling")
    normalization: str = option("LayerNorm", help="LayerNorm or RMSNorm")
    norm_epsilon: float = option(1e-5, help="epsilon of the normalisation layers")
    apply_layernorm_1p: bool = option(
        False, help="norm weights stored zero-centred and applied as 1 + weight (megatron-core's "
                    "layernorm_zero_centered_gamma; initialised to 0): the same model as without the flag, "
                    "with every norm weight shifted by -1")
    qk_layernorm: bool = option(
        False, help="normalise queries and keys per head before attention (megatron-core's qk_layernorm, "
                    "with --normalization's kind); not with Ulysses/FPDT attention (--context-parallel-size > 1, "
                    "--fpdt), which applies none")
    swiglu: bool = option(False, help="gated SiLU MLP (Llama)")
    untie_embeddings_and_output_weights: bool = option(False, help="separate output layer weights")
    add_bias_linear: bool = option(True, flag="--disable-bias-linear", inverted=True,
                                   help="no biases in the linear layers")
    add_qkv_bias: bool = option(False, help="bias in the QKV projection even with --disable-bias-linear")
    hidden_dropout: float = option(0.1, help="dropout after attention and MLP")
    attention_dropout: float = option(0.1, help="dropout of attention probabilities")
    init_method_std: float = option(0.02, help="standard deviation of the weight initialisation")
    make_vocab_size_divisible_by: int = option(
        128, help="pad the vocabulary to a multiple of this x tensor-parallel size")
    transformer_impl: str = option("auto", choices=("auto", "local", "transformer_engine"),
                                   help="layer implementation (auto: transformer_engine when importable on a GPU)")
    allow_unverified_gpu_paths: bool = option(
        False, help="keep GPU paths not yet verified by tools/gpu_acceptance.sh (WeiPipe over Transformer Engine "
                    "layers, dropout replay under them) instead of falling back to local layers with a notice")
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS,
        help="core attention (Megatron-LM's values). Local layers: auto/flash/fused = torch's fused "
             "scaled_dot_product_attention (on a GPU its flash/cuDNN/memory-efficient kernels only), "
             "unfused/local = megatron-core's DotProductAttention; Transformer Engine layers: TE's "
             "flash/fused/unfused choice (NVTE_*_ATTN), local = local layers")
    recompute_activations: bool = option(
        False, help="selective activation recomputation: sets --recompute-granularity selective, as in Megatron-LM")
    recompute_granularity: Optional[str] = option(
        None, choices=("full", "selective"),
        help="activation recomputation: full (whole layers from their inputs) or selective (the "
             "--recompute-modules inside every layer, megatron-core's)")
    recompute_modules: Optional[list[str]] = option(
        None, choices=SELECTIVE_MODULES + tuple(NOT_BUILT_MODULES),
        help="with --recompute-granularity selective, what every layer recomputes in backward instead of "
             "keeping (megatron-core's recompute_modules; default core_attn): core_attn (the attention "
             "scores, probabilities and their dropout), mlp (the MLP's intermediates), layernorm (the two "
             "norms' outputs); MoE, MLA, GatedDelta and mHC modules are refused (no such layers here)")
    recompute_method: Optional[str] = option(None, help="with full recomputation: uniform or block")
    recompute_num_layers: Optional[int] = option(None, help="layers per recomputed group (full) or recomputed "
                                                           "layers per stage (block)")
    offload_layer_inputs: bool = option(
        False, help="with full recomputation, keep each recomputed layer's input in host memory between its "
                    "forward and its recompute (prefetched one layer ahead); see docs/how-it-works/fpdt.md")
    layout_invariant_init: bool = option(
        True, flag="--no-layout-invariant-init", inverted=True,
        help="use megatron-core's per-rank initialisation instead of one that is the same for every parallel "
             "layout (the default lets a run switch TP/PP/schedule at equal seed)")
    use_cpu_initialization: bool = option(
        False, help="megatron-core builds each weight's full tensor in host memory and copies this rank's shard "
                    "to the GPU (always so on a CPU host). The initial values do not change: the default "
                    "layout-invariant init draws them on the GPU afterwards; with --no-layout-invariant-init "
                    "megatron-core draws each full tensor on the CPU and keeps this rank's shard, as Megatron-LM does")

    def shape(self, micro_batch_size: int = 1, vocab_size: int = 32000) -> ModelShape:
        """The shape arithmetic of this model (FFN width, parameter counts, FLOPs)."""
        own = {name: getattr(self, name) for name in _SHAPE_FIELDS}
        return ModelShape(**own, micro_batch_size=micro_batch_size, vocab_size=vocab_size)

    @staticmethod
    def shape_fields() -> tuple[str, ...]:
        """The fields a ModelShape has too (what ``shape`` and ``from_shape`` carry)."""
        return _SHAPE_FIELDS

    @classmethod
    def from_shape(cls, shape: ModelShape, **overrides) -> "ModelConfig":
        """A model of this shape (the simulator's and the calibrator's way back to a config)."""
        own = {name: getattr(shape, name) for name in _SHAPE_FIELDS}
        return cls(**own, group_query_attention=shape.num_query_groups is not None, **overrides)

    @property
    def ffn(self) -> int:
        return ffn_hidden_size(self.hidden_size, self.swiglu, self.ffn_hidden_size)

    def validate(self) -> None:
        if self.group_query_attention or self.num_query_groups is not None:
            require(self.num_query_groups is not None and self.num_query_groups > 0,
                    "--group-query-attention needs --num-query-groups > 0")
        self.shape().validate()
        if self.position_embedding_type == "learned_absolute":
            require(self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
                    f"--max-position-embeddings ({self.max_position_embeddings}) must be at least "
                    f"--seq-length ({self.seq_length})")
        require(self.transformer_impl in ("auto", "local", "transformer_engine"),
                f"--transformer-impl must be local or transformer_engine, not {self.transformer_impl!r}")
        require(self.recompute_granularity in (None, "full", "selective"),
                f"--recompute-granularity must be full or selective, not {self.recompute_granularity!r}")
        if self.recompute_granularity == "full":
            require(self.recompute_method in ("uniform", "block"),
                    "--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_granularity == "selective":
            self._validate_selective()
        require(not self.offload_layer_inputs or self.recompute_granularity == "full",
                "--offload-layer-inputs needs --recompute-granularity full (it offloads the layer inputs that "
                "full recomputation keeps)")
        require(0.0 <= self.hidden_dropout < 1.0, "--hidden-dropout must be in [0, 1)")
        require(0.0 <= self.attention_dropout < 1.0, "--attention-dropout must be in [0, 1)")

    def _validate_selective(self) -> None:
        """Megatron-LM's rules of selective recomputation, and the modules this package builds."""
        require(self.recompute_method is None,
                "--recompute-method applies to --recompute-granularity full only (Megatron-LM: not supported "
                "for selective recomputation)")
        require(self.recompute_num_layers is None,
                "--recompute-num-layers applies to --recompute-granularity full only (megatron-core: must be "
                "None for selective recomputation)")
        for name in self.selective_modules:
            require(name not in NOT_BUILT_MODULES,
                    f"--recompute-modules {name} recomputes part of a {NOT_BUILT_MODULES.get(name)} layer, "
                    "which this package does not build")
            require(name in SELECTIVE_MODULES, f"--recompute-modules {name} is not one of {', '.join(SELECTIVE_MODULES)}")

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """What every layer recomputes in backward under selective recomputation (megatron-core's
        default ``core_attn`` when --recompute-modules is not given); () without it."""
        if self.recompute_granularity != "selective":
            return ()
        return tuple(self.recompute_modules) if self.recompute_modules is not None else ("core_attn",)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


_SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape) if f.name in {g.name for g in fields(ModelConfig)})
