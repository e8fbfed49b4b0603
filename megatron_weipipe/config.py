"""Typed run configuration: the one definition of every flag, validated once at start-up.

Each field declared with ``option`` is a command-line flag (``megatron_weipipe.flags``
builds argparse from the fields). Every rule that a flag combination must obey is checked
here or by the capability that owns the flag (FPDT, data, the schedules), before any
process group exists, so a bad command line fails on every rank with the same one
sentence instead of hanging in a collective later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from megatron_weipipe import batch_sizes
from megatron_weipipe.checkpoint_config import CheckpointConfig
from megatron_weipipe.data.config import DataConfig
from megatron_weipipe.errors import ConfigError, require
from megatron_weipipe.flags import option
from megatron_weipipe.fp8_config import FP8Config
from megatron_weipipe.fpdt.config import FPDTConfig, cp_heads_fit
from megatron_weipipe.logging_config import LoggingConfig
from megatron_weipipe.megatron_compat import MegatronCompatConfig
from megatron_weipipe.model_config import ModelConfig
from megatron_weipipe.offload_config import OffloadConfig
from megatron_weipipe.parallel_config import ParallelConfig

# --lr-decay-style: the styles megatron-core's OptimizerParamScheduler runs with the flags
# this trainer has (its WSD style needs wsd_decay_steps, which no flag sets).
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")




def one_of(choices) -> str:
    """``a, b or c``: the accepted values in a help text or an error."""
    items = [str(c) for c in choices]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


@dataclass
class TrainingConfig:
    micro_batch_size: int = option(1, help="samples per microbatch")
    global_batch_size: Optional[int] = option(None, help="samples per optimizer step (default: micro batch x "
                                                         "data-parallel size)")
    train_iters: Optional[int] = option(None, help="optimizer steps to train (this or --train-samples)")
    train_samples: Optional[int] = option(
        None, help="samples to train instead of --train-iters: --train-samples // --global-batch-size steps, "
                   "the learning-rate schedule counted in samples (Megatron-LM's sample-based training)")
    rampup_batch_size: Optional[list[int]] = option(
        None, help="START INCREMENT RAMPUP_SAMPLES: the global batch size starts at START and grows by INCREMENT "
                   "to --global-batch-size over RAMPUP_SAMPLES consumed samples (megatron-core's microbatch "
                   "calculator; with --train-samples, as in Megatron-LM)")
    step_batch_size_schedule: Optional[str] = option(
        None, help='"THRESHOLD:BS THRESHOLD:BS ...": global batch size BS from THRESHOLD consumed tokens on '
                   "(suffixes K, M, B, T; the first threshold 0); --global-batch-size is the last BS")
    decrease_batch_size_if_needed: bool = option(
        False, help="round a --global-batch-size that micro batch x data-parallel size does not divide down to a "
                    "multiple of it (megatron-core's calculator; the rest of each batch is not trained)")
    lr: float = option(1e-4, help="peak learning rate")
    min_lr: float = option(0.0, help="learning rate at the end of the decay")
    decoupled_lr: Optional[float] = option(
        None, help="peak learning rate of the embedding and output layer (megatron-core's parameter groups of "
                   "the is_embedding_or_output_parameter weights); the other weights follow --lr")
    decoupled_min_lr: Optional[float] = option(
        None, help="learning rate of the embedding and output layer at the end of the decay (default: --min-lr; "
                   "only with --decoupled-lr, as in Megatron-LM)")
    lr_decay_style: str = option("cosine", help=f"learning-rate decay after the warm-up: {one_of(LR_DECAY_STYLES)}")
    lr_warmup_iters: int = option(0, help="warm-up steps")
    lr_warmup_samples: int = option(0, help="warm-up samples (with --train-samples)")
    lr_warmup_fraction: Optional[float] = option(None, help="warm-up as a fraction of the decay steps or samples")
    lr_decay_iters: Optional[int] = option(None, help="decay steps (default: --train-iters)")
    lr_decay_samples: Optional[int] = option(None, help="decay samples (with --train-samples; default: "
                                                        "--train-samples)")
    weight_decay: float = option(0.01, help="weight decay")
    use_checkpoint_opt_param_scheduler: bool = option(
        False, flag="--use-checkpoint-opt_param-scheduler",
        help="on --load, take the learning-rate and weight-decay schedule (peak and minimum LR, warm-up and decay "
             "lengths, style) from the checkpoint; without this or --override-opt_param-scheduler a schedule "
             "that differs from the checkpoint's stops the load, as in Megatron-LM")
    override_opt_param_scheduler: bool = option(
        False, flag="--override-opt_param-scheduler",
        help="on --load, take the schedule from these flags, not from the checkpoint (the position in it, "
             "the samples consumed, is still the checkpoint's)")
    clip_grad: float = option(1.0, help="gradient-norm clipping (0: off)")
    optimizer: str = option("adam", help="adam or sgd")
    adam_beta1: float = option(0.9, help="Adam beta1")
    adam_beta2: float = option(0.999, help="Adam beta2")
    adam_eps: float = option(1e-8, help="Adam epsilon")
    sgd_momentum: float = option(0.9, help="SGD momentum")
    bf16: bool = option(False, help="bf16 weights and activations, fp32 master weights")
    fp16: bool = option(False, help="fp16 weights and activations, fp32 master weights")
    grad_reduce_in_bf16: bool = option(
        False, help="under --bf16, accumulate and reduce the gradients in bf16 (megatron-core DDP's buffers, "
                    "WeiPipe's and FSDP2's data-parallel reduction); without --bf16 no effect, as in Megatron-LM")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False, help="accumulate and reduce the gradients in fp32: always under --bf16 unless "
                    "--grad-reduce-in-bf16, under --fp16 only with this flag (Megatron-LM's rule)")
    calculate_per_token_loss: bool = option(
        False, help="the loss of a global batch is the sum of its masked token losses over the number of loss "
                    "tokens of the whole batch (all microbatches, data- and context-parallel ranks), not the mean "
                    "of per-microbatch means; gradients are divided by that count once, after their reduction")
    seed: int = option(1234, help="random seed (initialisation, dropout, data order)")
    eval_interval: int = option(1000, help="steps between validation runs")
    eval_iters: int = option(10, help="microbatch iterations per validation run")
    skip_train: bool = option(False, help="load, validate, and stop")
    exit_interval: Optional[int] = option(None, help="save and exit at a multiple of this step")
    exit_duration_in_mins: Optional[float] = option(None, help="save and exit after this many minutes")
    exit_signal_handler: bool = option(False, help="on SIGTERM finish the step, save and exit 0")
    check_for_nan_in_loss_and_grad: bool = option(
        True, flag="--no-check-for-nan-in-loss-and-grad", inverted=True,
        help="do not stop on a NaN/Inf loss or gradient norm")
    skip_nan_steps: bool = option(False, help="skip an optimizer step whose loss or grad is NaN/Inf")
    deterministic: bool = option(False, flag="--deterministic-mode", help="deterministic algorithms only")
    manual_gc: bool = option(False, help="Python's automatic garbage collection off while training; collect at "
                                         "--manual-gc-interval and around evaluation, at the same step on every rank")
    manual_gc_interval: int = option(0, help="with --manual-gc: collect every this many iterations (0: only at the "
                                             "start and around evaluation)")
    manual_gc_eval: bool = option(True, flag="--no-manual-gc-eval", inverted=True,
                                  help="with --manual-gc: no collection at the start and end of each evaluation")
    empty_unused_memory_level: int = option(0, choices=(0, 1, 2),
                                            help="empty the CUDA caching allocator: 1 after each forward/backward "
                                                 "and evaluation step, 2 also after each optimizer step (nothing "
                                                 "on a CPU host)")

    def validate(self) -> None:
        require(self.micro_batch_size > 0, "--micro-batch-size must be positive")
        require(self.train_iters is None or self.train_iters >= 0, "--train-iters must be non-negative")
        require(self.lr >= 0, "--lr must be non-negative")
        require(self.lr_decay_style in LR_DECAY_STYLES,
                f"--lr-decay-style must be {one_of(LR_DECAY_STYLES)}, not {self.lr_decay_style!r}")
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive")
        require(self.optimizer in ("adam", "sgd"), f"--optimizer must be adam or sgd, not {self.optimizer!r}")
        require(self.eval_interval > 0, "--eval-interval must be positive")
        require(self.clip_grad >= 0, "--clip-grad must be non-negative")
        require(self.manual_gc_interval >= 0, "--manual-gc-interval must be non-negative")
        self._validate_decoupled_lr()
        require(not (self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler),
                "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are mutually exclusive")
        batch_sizes.check_flags(self)
        if self.train_samples is not None:
            self._validate_sample_based()
            return
        self._refuse_sample_flags()
        decay = self.lr_decay_iters or self.train_iters or 0
        require(self.warmup_iters == 0 or self.warmup_iters < decay,
                f"--lr-warmup-iters ({self.warmup_iters}) must be smaller than --lr-decay-iters or --train-iters "
                f"({decay})")

    def require_run_length(self) -> None:
        """A training run needs its length (the simulator, which trains nothing, does not)."""
        require(self.train_iters is not None or self.train_samples is not None,
                "give --train-iters or --train-samples (the run's length)")

    def _validate_decoupled_lr(self) -> None:
        if self.decoupled_lr is None:
            return
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        require(0 <= low <= self.decoupled_lr,
                f"--decoupled-lr ({self.decoupled_lr}) must be at least --decoupled-min-lr or --min-lr ({low}) "
                "and that at least 0")

    def _refuse_sample_flags(self) -> None:
        """Megatron-LM's asserts of iteration-based training."""
        require(self.lr_decay_samples is None,
                "--lr-decay-samples needs --train-samples (iteration-based training decays over --lr-decay-iters)")
        require(self.lr_warmup_samples == 0,
                "--lr-warmup-samples needs --train-samples (iteration-based training warms up over "
                "--lr-warmup-iters)")

    def _validate_sample_based(self) -> None:
        """Megatron-LM's asserts of sample-based training, and megatron-core's scheduler's."""
        require(self.train_iters is None, "--train-iters and --train-samples cannot both be given (iteration- or "
                                          "sample-based training, as in Megatron-LM)")
        require(self.lr_decay_iters is None, "--lr-decay-iters cannot be combined with --train-samples; give "
                                             "--lr-decay-samples")
        require(self.lr_warmup_iters == 0, "--lr-warmup-iters cannot be combined with --train-samples; give "
                                           "--lr-warmup-samples")
        require(self.lr_warmup_fraction is None or self.lr_warmup_samples == 0,
                "can only specify one of --lr-warmup-fraction and --lr-warmup-samples")
        require(self.train_samples > 0, "--train-samples must be positive")
        decay, warmup = self.lr_decay_steps, self.lr_warmup_steps
        require(decay > 0, "--lr-decay-samples must be positive")
        require(warmup < decay, f"--lr-warmup-samples ({warmup}) must be smaller than --lr-decay-samples or "
                                f"--train-samples ({decay})")

    @property
    def iterations(self) -> int:
        """Optimizer steps of a run at a fixed batch size: --train-iters, or --train-samples //
        --global-batch-size (Megatron-LM's update_train_iters; PretrainConfig.train_iters counts a ramp's)."""
        if self.train_samples is not None:
            return self.train_samples // self.global_batch_size
        return self.train_iters

    @property
    def warmup_iters(self) -> int:
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * (self.lr_decay_iters or self.train_iters or 0))
        return self.lr_warmup_iters

    @property
    def lr_decay_steps(self) -> int:
        """The scheduler's decay length in samples, as Megatron-LM's get_optimizer_param_scheduler counts it."""
        if self.train_samples is not None:
            return self.train_samples if self.lr_decay_samples is None else self.lr_decay_samples
        return max(self.lr_decay_iters or self.train_iters, 1) * self.global_batch_size

    @property
    def lr_warmup_steps(self) -> float:
        """The scheduler's warm-up length in samples (a fraction of the decay samples is not rounded)."""
        if self.train_samples is not None:
            if self.lr_warmup_fraction is not None:
                return self.lr_warmup_fraction * self.lr_decay_steps
            return self.lr_warmup_samples
        return self.warmup_iters * self.global_batch_size

    @property
    def wd_incr_steps(self) -> int:
        """The weight-decay increment length in samples."""
        if self.train_samples is not None:
            return self.train_samples
        return max(self.train_iters, 1) * self.global_batch_size

    @property
    def grad_reduce_in_fp32(self) -> bool:
        """megatron-core DDP's ``grad_reduce_in_fp32``, as Megatron-LM's arguments.py derives
        --accumulate-allreduce-grads-in-fp32: forced on under --bf16 unless --grad-reduce-in-bf16
        (which wins), as given under --fp16 (off: fp16 gradients); fp32 training has fp32
        gradients either way."""
        if self.bf16:
            return not self.grad_reduce_in_bf16
        return self.accumulate_allreduce_grads_in_fp32 or not self.fp16

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of weights and activations in the compute dtype."""
        return 2 if (self.bf16 or self.fp16) else 4


@dataclass
class PretrainConfig:
    """The whole run; one object handed to every part of the framework.

    Build it with ``megatron_weipipe.arguments.parse_config`` (flags, derived defaults,
    every rule); ``validate`` only checks and never changes what it checks.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_length=128))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fpdt: FPDTConfig = field(default_factory=FPDTConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    megatron: MegatronCompatConfig = field(default_factory=MegatronCompatConfig)
    world_size: int = 1
    # (iteration, consumed samples) of the checkpoint loaded, once known (training/run_setup.py):
    # a batch-size schedule is checked from there on; None: from the start, unless --load may resume
    resumed_at: Optional[tuple[int, int]] = None

    # --- derived -------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.parallel.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel replica per optimizer step at --global-batch-size (the
        final one of a batch-size schedule; rounded down under --decrease-batch-size-if-needed)."""
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    @property
    def batch_size_steps(self) -> Optional[batch_sizes.Steps]:
        """--rampup-batch-size or --step-batch-size-schedule as steps; None at a fixed batch size."""
        t = self.training
        if t.step_batch_size_schedule is not None:
            return batch_sizes.parse_step_schedule(t.step_batch_size_schedule, self.model.seq_length)
        return None if t.rampup_batch_size is None else batch_sizes.ramp_steps(t.rampup_batch_size,
                                                                               t.global_batch_size)

    @property
    def train_iters(self) -> int:
        """Optimizer steps of the run (Megatron-LM's update_train_iters, a ramp's included)."""
        t, steps = self.training, self.batch_size_steps
        if steps is None or t.train_samples is None:
            return t.iterations
        return batch_sizes.iterations_for_samples(steps, t.train_samples)

    @property
    def train_samples_read(self) -> int:
        """Training samples the run reads (the training dataset's size)."""
        t, steps = self.training, self.batch_size_steps
        if steps is None:
            return t.iterations * t.global_batch_size if t.train_samples is None else t.train_samples
        return max(batch_sizes.samples_read(steps, self.train_iters), t.train_samples or 0)

    def batch_size_changes(self) -> list[tuple[int, int, int]]:
        """(iteration, consumed samples, global batch size) where a batch-size schedule starts or
        changes, from the start or ``resumed_at`` on; [] at a fixed batch size, and while a
        --load may resume at a point not known yet."""
        steps = self.batch_size_steps
        if steps is None or (self.resumed_at is None and self.checkpoint.load):
            return []
        iteration, consumed = self.resumed_at or (0, 0)
        return batch_sizes.changes(steps, consumed, iteration, self.train_iters)

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule; filled in from the layout by ``arguments.resolve_defaults``."""
        name = self.parallel.pipeline_schedule
        if name is None:
            raise ConfigError("no --pipeline-schedule resolved; build the config with arguments.parse_config")
        return name

    def with_derived_defaults(self, schedule_name: str) -> "PretrainConfig":
        """A copy with every default that depends on other values filled in: the global
        batch (a step schedule's last), the schedule, what Megatron-LM turns off
        (ParallelConfig.resolved), selective recomputation (from --recompute-activations), and the
        data's sequence length and seed."""
        t, mp = self.training, self.parallel.model_parallel_size
        # megatron-core's dataset separates documents only in the mask it builds (Megatron-LM:
        # --no-create-attention-mask-in-dataloader drops --reset-attention-mask's effect)
        reset = self.data.reset_attention_mask and self.data.create_attention_mask_in_dataloader
        gbs = t.global_batch_size
        if gbs is None and t.step_batch_size_schedule is not None:
            gbs = batch_sizes.parse_step_schedule(t.step_batch_size_schedule, self.model.seq_length).final
        if gbs is None and mp > 0 and self.world_size % mp == 0:
            gbs = t.micro_batch_size * self.data_parallel_size
        m = self.model
        if m.recompute_activations:  # Megatron-LM's shorthand, over any --recompute-granularity
            m = replace(m, recompute_granularity="selective")
        return replace(
            self,
            model=m,
            training=replace(t, global_batch_size=gbs),
            parallel=self.parallel.resolved(schedule_name),
            data=replace(self.data, seq_length=self.model.seq_length, seed=t.seed, reset_attention_mask=reset,
                         # Ulysses/FPDT take document offsets computed in the forward step, never [s, s].
                         create_attention_mask=reset and not self._long_context()),
        )

    def _long_context(self) -> bool:
        """Ulysses or FPDT attention (this package's context parallelism), not megatron-core's."""
        p = self.parallel
        return (p.context_parallel_size > 1 and not p.megatron_context_parallel) or self.fpdt.enabled

    def validate(self) -> None:
        """Check every rule of the flags (not the data files, see DataConfig.validate);
        raises ConfigError with one sentence."""
        m, p, t = self.model, self.parallel, self.training
        m.validate()
        t.validate()
        self.checkpoint.validate()
        self.logging.validate()
        self.megatron.validate()
        p.validate()
        require(self.world_size % p.model_parallel_size == 0,
                f"world size ({self.world_size}) must be divisible by tensor x pipeline x context "
                f"parallel size ({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
                f"{p.context_parallel_size} = {p.model_parallel_size})")
        p.validate_data_parallel_size(self.data_parallel_size)
        require(not (p.tp_comm_overlap and t.deterministic),
                "--tp-comm-overlap cannot be combined with --deterministic-mode (the overlapped collectives' order "
                "is not reproducible), as in Megatron-LM")
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        require(m.num_layers % pp == 0,
                f"--num-layers ({m.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            v = p.num_layers_per_virtual_pipeline_stage
            require(v > 0, "--num-layers-per-virtual-pipeline-stage must be positive")
            require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            require(m.num_layers % (pp * v) == 0,
                    f"--num-layers ({m.num_layers}) must be divisible by pipeline size x "
                    f"--num-layers-per-virtual-pipeline-stage ({pp} x {v})")
            require(m.num_layers // (pp * v) > 1,
                    "--num-layers-per-virtual-pipeline-stage must leave at least 2 virtual stages per rank")
        require(m.num_attention_heads % tp == 0,
                f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
        require(m.query_groups % tp == 0,
                f"--num-query-groups ({m.query_groups}) must be divisible by --tensor-model-parallel-size ({tp})")
        batch_sizes.check_sizes(self)
        if p.megatron_context_parallel:
            self._validate_megatron_context_parallel()
        elif p.context_parallel_size > 1:
            cp = p.context_parallel_size
            cp_heads_fit(m.num_attention_heads, m.query_groups, cp, tp)
            require(m.seq_length % cp == 0,
                    f"--seq-length ({m.seq_length}) must be divisible by --context-parallel-size ({cp})")
        if self._long_context():
            require(m.attention_dropout == 0.0,
                    "--attention-dropout must be 0 with Ulysses/FPDT attention (--context-parallel-size > 1 or "
                    "--fpdt)")
            require(not p.sequence_parallel,
                    "--sequence-parallel cannot be combined with --context-parallel-size > 1 or --fpdt")
            require(not m.qk_layernorm,
                    "--qk-layernorm cannot be combined with --context-parallel-size > 1 or --fpdt (their attention "
                    "applies no query/key norms)")
        if self.fpdt.enabled:
            self.fpdt.validate(m.seq_length, p.context_parallel_size)
            require("core_attn" not in m.selective_modules,
                    "--recompute-modules core_attn (selective recomputation's default) does not apply with --fpdt: "
                    "its chunked attention keeps no [s, s] scores (q, k, v, output and log-sum-exp per chunk, on the "
                    "host with --fpdt-offload) and recomputes the scores block by block in backward; use "
                    "--recompute-modules layernorm")
        self.fp8.validate(long_context=self._long_context(),
                          sharded_params=p.use_distributed_optimizer or p.use_torch_fsdp2)
        self.offload.validate(distributed_optimizer=p.use_distributed_optimizer, fsdp2=p.use_torch_fsdp2,
                              optimizer=t.optimizer, half=t.bf16 or t.fp16, fp8_param_gather=self.fp8.fp8_param_gather,
                              fp8_recipe=self.fp8.fp8_recipe)
        if p.use_torch_fsdp2:
            self._validate_fsdp()

    def _validate_megatron_context_parallel(self) -> None:
        """--cp-comm-type p2p / allgather / a2a+p2p: megatron-core's context parallelism inside
        Transformer Engine's attention (the host rule is model/layer_choice.check_host)."""
        m, p, cp = self.model, self.parallel, self.parallel.context_parallel_size
        kind = next(t for t in p.cp_comm_type if t != "a2a")
        require(len(p.cp_comm_type) in (1, m.num_layers),
                f"--cp-comm-type takes one value or one per layer ({m.num_layers}), not {len(p.cp_comm_type)}")
        require(m.seq_length % (2 * cp) == 0,
                f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size ({2 * cp}) for "
                f"--cp-comm-type {kind} (megatron-core's load-balanced sequence split)")
        require(not self.fpdt.enabled, f"--fpdt is chunked Ulysses attention: it takes --cp-comm-type a2a, not {kind}")
        require(not self.data.reset_attention_mask,
                f"--reset-attention-mask cannot be combined with --cp-comm-type {kind} (Transformer Engine's context "
                "parallelism takes causal masks only here; --cp-comm-type a2a supports packed documents)")

    def _validate_fsdp(self) -> None:
        """--use-torch-fsdp2: what the FSDP2 data-parallel mode composes with (docs/how-it-works/fsdp.md)."""
        p, t = self.parallel, self.training
        require(p.pipeline_model_parallel_size == 1,
                "--use-torch-fsdp2 needs --pipeline-model-parallel-size 1 (FSDP is a data-parallel mode; no 1F1B "
                "or WeiPipe pipeline)")
        require(p.tensor_model_parallel_size == 1, "--use-torch-fsdp2 needs --tensor-model-parallel-size 1")
        require(not p.use_distributed_optimizer,
                "--use-torch-fsdp2 cannot be combined with --use-distributed-optimizer (FSDP shards the "
                "optimizer state itself)")
        require(not p.overlap_grad_reduce,
                "--use-torch-fsdp2 cannot be combined with --overlap-grad-reduce (FSDP issues its own "
                "reduce-scatters)")
        require(not p.use_nccl_ub, "--use-nccl-ub registers megatron-core DDP's buffers; --use-torch-fsdp2 "
                                   "allocates its own")
        require(self.model.untie_embeddings_and_output_weights,
                "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (as in Megatron-LM)")
        require(not t.fp16, "--use-torch-fsdp2 runs in float32 or --bf16 here (no --fp16: it would need a "
                            "gradient scaler over the sharded gradients)")
