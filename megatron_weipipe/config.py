"""Typed run configuration, validated once at start-up.

Every rule that a flag combination must obey is checked here, before any process
group exists, so a bad command line fails on every rank with the same one sentence
instead of hanging in a collective later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from megatron_weipipe.data.datasets import DataConfig


class ConfigError(ValueError):
    """A flag value or combination that cannot work; the message names the flag and the rule."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    group_query_attention: bool = False
    kv_channels: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "auto"  # auto | local | transformer_engine
    recompute_granularity: Optional[str] = None  # None | full | selective
    recompute_method: Optional[str] = None  # uniform | block
    recompute_num_layers: Optional[int] = None
    layout_invariant_init: bool = True

    def validate(self) -> None:
        _require(self.num_layers > 0, "--num-layers must be positive")
        _require(self.hidden_size > 0, "--hidden-size must be positive")
        _require(self.num_attention_heads > 0, "--num-attention-heads must be positive")
        _require(
            self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
            f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
            f"({self.num_attention_heads}) unless --kv-channels is given",
        )
        if self.group_query_attention or self.num_query_groups is not None:
            _require(
                self.num_query_groups is not None and self.num_query_groups > 0,
                "--group-query-attention needs --num-query-groups > 0",
            )
            _require(
                self.num_attention_heads % self.num_query_groups == 0,
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})",
            )
        _require(self.seq_length > 0, "--seq-length must be positive")
        _require(
            self.position_embedding_type in ("learned_absolute", "rope", "none"),
            f"--position-embedding-type must be learned_absolute, rope or none, not "
            f"{self.position_embedding_type!r}",
        )
        if self.position_embedding_type == "learned_absolute":
            _require(
                self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) must be at least "
                f"--seq-length ({self.seq_length})",
            )
        _require(
            self.normalization in ("LayerNorm", "RMSNorm"),
            f"--normalization must be LayerNorm or RMSNorm, not {self.normalization!r}",
        )
        _require(
            self.transformer_impl in ("auto", "local", "transformer_engine"),
            f"--transformer-impl must be local or transformer_engine, not {self.transformer_impl!r}",
        )
        _require(
            self.recompute_granularity in (None, "full", "selective"),
            f"--recompute-granularity must be full or selective, not {self.recompute_granularity!r}",
        )
        if self.recompute_granularity == "full":
            _require(
                self.recompute_method in ("uniform", "block"),
                "--recompute-granularity full needs --recompute-method uniform or block",
            )
        _require(0.0 <= self.hidden_dropout < 1.0, "--hidden-dropout must be in [0, 1)")
        _require(0.0 <= self.attention_dropout < 1.0, "--attention-dropout must be in [0, 1)")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    context_parallel_size: int = 1
    pipeline_schedule: Optional[str] = None  # None: 1f1b / interleaved / none from the sizes
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    distributed_backend: Optional[str] = None  # nccl | gloo; None: from the platform
    distributed_timeout_minutes: int = 10
    weipipe_grad_dtype: str = "fp32"  # fp32 | bf16 (the gradient flow of WeiPipe)

    def virtual_pipeline_size(self, num_layers: int) -> Optional[int]:
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    train_iters: int = 10
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    optimizer: str = "adam"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    bf16: bool = False
    fp16: bool = False
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    skip_nan_steps: bool = False
    deterministic: bool = False

    def validate(self) -> None:
        _require(self.micro_batch_size > 0, "--micro-batch-size must be positive")
        _require(self.train_iters >= 0, "--train-iters must be non-negative")
        _require(self.lr >= 0, "--lr must be non-negative")
        _require(
            self.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
            f"--lr-decay-style must be constant, linear or cosine, not {self.lr_decay_style!r}",
        )
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive")
        _require(self.optimizer in ("adam", "sgd"), f"--optimizer must be adam or sgd, not {self.optimizer!r}")
        _require(self.eval_interval > 0, "--eval-interval must be positive")
        _require(self.clip_grad >= 0, "--clip-grad must be non-negative")
        decay = self.lr_decay_iters or self.train_iters
        _require(
            self.warmup_iters == 0 or self.warmup_iters < decay,
            f"--lr-warmup-iters ({self.warmup_iters}) must be smaller than --lr-decay-iters or --train-iters ({decay})",
        )

    @property
    def warmup_iters(self) -> int:
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * (self.lr_decay_iters or self.train_iters))
        return self.lr_warmup_iters


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_format: str = "torch_dist"

    def validate(self) -> None:
        _require(self.ckpt_format == "torch_dist", "--ckpt-format must be torch_dist")
        _require(
            self.save_interval is None or self.save_interval > 0, "--save-interval must be positive"
        )
        _require(
            self.save_interval is None or self.save is not None, "--save-interval needs --save DIR"
        )


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    log_throughput: bool = True
    timing_log_level: int = 0

    def validate(self) -> None:
        _require(self.log_interval > 0, "--log-interval must be positive")


@dataclass
class FPDTFlags:
    """--fpdt, --fpdt-chunk-size, --fpdt-offload: chunked Ulysses attention (FPDT)."""

    enabled: bool = False
    chunk_size: int = 65536
    offload: bool = False

    def validate_for(self, seq_length: int, context_parallel_size: int) -> None:
        cp = context_parallel_size
        _require(self.chunk_size > 0, "--fpdt-chunk-size must be positive")
        _require(
            self.chunk_size <= seq_length,
            f"--fpdt-chunk-size ({self.chunk_size}) must not exceed --seq-length ({seq_length})",
        )
        _require(
            seq_length % self.chunk_size == 0,
            f"--seq-length ({seq_length}) must be a multiple of --fpdt-chunk-size ({self.chunk_size})",
        )
        _require(
            self.chunk_size % cp == 0,
            f"--fpdt-chunk-size ({self.chunk_size}) must be divisible by --context-parallel-size ({cp})",
        )


@dataclass
class PretrainConfig:
    """The whole run; one object handed to every part of the framework."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_length=128))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fpdt: FPDTFlags = field(default_factory=FPDTFlags)
    world_size: int = 1

    # --- derived -------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.parallel.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel replica per optimizer step."""
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    @property
    def schedule_name(self) -> str:
        from megatron_weipipe.schedules.registry import default_schedule_name

        return self.parallel.pipeline_schedule or default_schedule_name(self)

    def validate(self) -> None:
        """Check every rule once; raises ConfigError with one sentence."""
        m, p, t = self.model, self.parallel, self.training
        m.validate()
        t.validate()
        self.checkpoint.validate()
        self.logging.validate()
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _require(getattr(p, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        _require(
            self.world_size % p.model_parallel_size == 0,
            f"world size ({self.world_size}) must be divisible by tensor x pipeline x context "
            f"parallel size ({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
            f"{p.context_parallel_size} = {p.model_parallel_size})",
        )
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        _require(
            m.num_layers % pp == 0,
            f"--num-layers ({m.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})",
        )
        if p.num_layers_per_virtual_pipeline_stage is not None:
            v = p.num_layers_per_virtual_pipeline_stage
            _require(v > 0, "--num-layers-per-virtual-pipeline-stage must be positive")
            _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            _require(
                m.num_layers % (pp * v) == 0,
                f"--num-layers ({m.num_layers}) must be divisible by pipeline size x "
                f"--num-layers-per-virtual-pipeline-stage ({pp} x {v})",
            )
            _require(
                m.num_layers // (pp * v) > 1,
                "--num-layers-per-virtual-pipeline-stage must leave at least 2 virtual stages per rank",
            )
        _require(
            m.num_attention_heads % tp == 0,
            f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            m.query_groups % tp == 0,
            f"--num-query-groups ({m.query_groups}) must be divisible by --tensor-model-parallel-size ({tp})",
        )
        if p.sequence_parallel:
            _require(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        dp = self.data_parallel_size
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _require(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size x "
            f"data-parallel size ({t.micro_batch_size} x {dp})",
        )
        if p.context_parallel_size > 1:
            cp = p.context_parallel_size
            _require(
                m.num_attention_heads % (cp * tp) == 0,
                f"--num-attention-heads ({m.num_attention_heads}) must be divisible by context x tensor "
                f"parallel size ({cp} x {tp}) for Ulysses attention",
            )
            _require(
                m.query_groups % (cp * tp) == 0,
                f"--num-query-groups ({m.query_groups}) must be divisible by context x tensor parallel "
                f"size ({cp} x {tp}) for Ulysses attention",
            )
            _require(
                m.seq_length % cp == 0,
                f"--seq-length ({m.seq_length}) must be divisible by --context-parallel-size ({cp})",
            )
        if p.context_parallel_size > 1 or self.fpdt.enabled:
            _require(
                m.attention_dropout == 0.0,
                "--attention-dropout must be 0 with Ulysses/FPDT attention (--context-parallel-size > 1 or --fpdt)",
            )
            _require(
                not self.data.reset_attention_mask,
                "--reset-attention-mask is not supported with Ulysses/FPDT attention (causal masks only)",
            )
            _require(not p.sequence_parallel, "--sequence-parallel cannot be combined with --context-parallel-size > 1 or --fpdt")
        if self.fpdt.enabled:
            self.fpdt.validate_for(seq_length=m.seq_length, context_parallel_size=p.context_parallel_size)
        _require(p.weipipe_grad_dtype in ("fp32", "bf16"), "--weipipe-grad-dtype must be fp32 or bf16")
        self.data.seq_length = m.seq_length
        self.data.seed = t.seed
        try:
            self.data.validate()
        except ConfigError:
            raise
        except ValueError as e:  # missing or corrupt data files: same one-line treatment
            raise ConfigError(str(e)) from e

        from megatron_weipipe.schedules.registry import get_schedule

        get_schedule(self.schedule_name).check_config(self)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = {g.name: getattr(v, g.name) for g in fields(v)} if hasattr(v, "__dataclass_fields__") else v
        return out


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's padding: a multiple of divisible_by x TP so the embedding splits evenly."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)
