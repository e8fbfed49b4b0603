"""What one simulated run is (``RunSpec``), and the training run it stands for, both ways.

The simulator's flags are pretrain_gpt.py's own (plus hardware and what-if options), so
a run description comes from the same ``PretrainConfig`` and is checked by the same
rules (the configs' and the schedule's), never by a second copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron_weipipe.arguments import check_config
from megatron_weipipe.config import ModelConfig, ParallelConfig, PretrainConfig, TrainingConfig
from megatron_weipipe.data.config import DataConfig
from megatron_weipipe.fpdt.config import FPDTConfig
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Action, Flow, Schedule
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.generate.megatron_timeline import megatron_timeline
from megatron_weipipe.schedules.generate.zb_h1 import zb_h1_timeline
from megatron_weipipe.shape import ModelShape

from megatron_weipipe.errors import SimulatorError, require_simulable
from .fpdt import FPDTSpec
from megatron_weipipe.simulator.rank_order import Layout

DEFAULT_VOCAB_SIZE = 32000  # when --vocab-size is not given (the simulator has no tokenizer)

# Baselines the simulator compares with but training does not run, each checked by the
# training rules of the schedule it is closest to: ZB-H1 (a 1F1B pipeline with a split
# backward), the floor of any activation pipeline (N x the slowest stage, no bubble, no
# wire), FSDP / ZeRO-3 (no pipeline: PP = 1, data parallel over the same GPUs).
BASELINES = {"zb-h1": "1f1b", "floor": "1f1b", "fsdp": "none"}


@dataclass(frozen=True)
class RunSpec:
    shape: ModelShape
    layout: Layout
    global_batch_size: int
    schedule: str
    virtual_stages: int = 2  # interleaved: model chunks per rank
    recompute: bool = False  # full activation recomputation
    compute_bytes: int = 2  # bf16 weights and activations (4 for the fp32 CPU runs)
    weipipe_grad_bytes: int = 4  # the gradient flow (--weipipe-grad-dtype)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    zero3: bool = False  # DeepSpeed ZeRO-3 model state (bf16 weights and grads, fp32 Adam), all sharded
    # --use-torch-fsdp2: fp32 weights, grads and Adam moments sharded over data x context
    # parallel ranks; one unit (a layer, or the root's embedding and output layer) gathered
    # in the compute dtype at a time
    torch_fsdp2: bool = False
    offload_layer_inputs: bool = False  # --offload-layer-inputs: recompute's kept inputs on the host
    attention_impl: str = "flash"  # "flash" (TE layers), "unfused" (local layers), "unfused+flash" (local, fused core)
    dropout: bool = True
    fpdt: Optional[FPDTSpec] = None
    lookahead: int = 1
    weight_pass: str = "stored"  # WeiPipe's split backward: activations freed at I ("stored") or at W
    kernel_efficiency: float = 1.0  # compute speed of this schedule's kernels relative to the cost model

    @property
    def training_schedule(self) -> str:
        """The schedule whose training rules apply (a baseline's nearest trained schedule)."""
        return BASELINES.get(self.schedule, self.schedule)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.shape.micro_batch_size * self.layout.dp)

    @property
    def is_weipipe(self) -> bool:
        return registry.entry(self.training_schedule).family == registry.WEIPIPE

    @property
    def stages(self) -> int:
        """Model chunks in the pipeline (P, or P x V for interleaved)."""
        return self.layout.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)

    @property
    def layers_per_chunk(self) -> int:
        return self.shape.num_layers // self.stages

    def validate(self) -> "RunSpec":
        """The training rules of the run this simulates, then what the simulator itself needs."""
        s, lay = self.shape, self.layout
        P, L = lay.pp, s.num_layers
        require_simulable(registry.find(self.training_schedule) is not None,
                f"--schedules: {self.schedule!r} is unknown; choose from {', '.join(schedule_choices())}")
        require_simulable(self.kernel_efficiency > 0, f"--kernel-efficiency of {self.schedule} must be positive")
        require_simulable(self.global_batch_size > 0, "--global-batch-size must be positive")
        if self.training_schedule != "none" and P == 1:
            raise SimulatorError(f"schedule {self.schedule} needs --pipeline-model-parallel-size >= 2")
        if self.schedule == "interleaved":
            V = self.virtual_stages
            require_simulable(V >= 2 and L % (P * V) == 0,
                    f"interleaved needs --num-layers ({L}) divisible by pipeline size x virtual stages ({P} x {V})")
        check_config(spec_to_config(self), check_data=False)
        return self

    def build_schedule(self, zb_costs: Optional[tuple[float, float, float]] = None) -> Schedule:
        """The action lists; ``zb_costs``: (F, I, W) of one stage, which zb-h1's order is built for."""
        P, N = self.layout.pp, self.num_microbatches
        if self.is_weipipe:
            return generate(self.schedule, P, N // P)
        if self.schedule == "interleaved":
            return megatron_timeline("interleaved", P, N, self.virtual_stages)
        if self.schedule == "zb-h1":
            return zb_h1_timeline(P, N, zb_costs or (1.0, 1.0, 1.0))
        return megatron_timeline("1f1b", P, N)

    # ------------------------------------------------------------ sizes
    def chunk_params(self) -> int:
        return self.layers_per_chunk * self.shape.layer_params(self.layout.tp)

    def replicated_params(self) -> int:
        """WeiPipe: embedding, final norm and output layer, on every ring rank."""
        s, tp = self.shape, self.layout.tp
        out = s.embedding_params(tp) + s.norm_params()
        return out + (s.word_embedding_params(tp) if s.untie_embeddings_and_output_weights else 0)

    def rank_params(self, r: int) -> int:
        """Parameters ring rank / pipeline rank r holds (one TP shard)."""
        s, tp, P = self.shape, self.layout.tp, self.layout.pp
        if self.is_weipipe:
            return self.chunk_params() + self.replicated_params()
        chunks = self.stages // P
        out = chunks * self.chunk_params()
        if r == 0:
            out += s.embedding_params(tp)
        if r == P - 1:  # final norm, and the output layer (a second copy of a tied embedding if P > 1)
            out += s.norm_params()
            if P > 1 or s.untie_embeddings_and_output_weights:
                out += s.word_embedding_params(tp)
        return out

    def rank_layers(self, r: int) -> int:
        """Transformer layers built on rank r (WeiPipe: one chunk's modules, run with every
        chunk's circulating weights)."""
        return self.layers_per_chunk * (1 if self.is_weipipe else self.stages // self.layout.pp)

    def activation_message_bytes(self) -> int:
        s, lay = self.shape, self.layout
        tokens = s.tokens // lay.cp // (lay.tp if self.sequence_parallel else 1)
        return tokens * s.hidden_size * self.compute_bytes

    def message_bytes(self, a: Action) -> int:
        if a.flow in (Flow.ACTIVATIONS, Flow.ACTIVATION_GRADS):
            return self.activation_message_bytes()
        per = self.weipipe_grad_bytes if a.flow is Flow.GRADS else self.compute_bytes
        return self.chunk_params() * per



def schedule_choices() -> tuple[str, ...]:
    """Every name --schedules takes: the trained schedules, then the baselines."""
    return registry.names() + tuple(BASELINES)


def spec_to_config(spec: RunSpec) -> PretrainConfig:
    """The training configuration a RunSpec simulates (validated with the training rules)."""
    s, lay = spec.shape, spec.layout
    long_context = lay.cp > 1 or spec.fpdt is not None
    model = ModelConfig.from_shape(
        s,
        hidden_dropout=0.1 if spec.dropout else 0.0,
        attention_dropout=0.1 if spec.dropout and not long_context else 0.0,
        recompute_granularity="full" if spec.recompute else None,
        recompute_method="uniform" if spec.recompute else None,
    )
    vpp = None
    if spec.schedule == "interleaved":
        vpp = s.num_layers // (lay.pp * spec.virtual_stages)
    parallel = ParallelConfig(
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp, context_parallel_size=lay.cp,
        num_layers_per_virtual_pipeline_stage=vpp, pipeline_schedule=spec.training_schedule,
        sequence_parallel=spec.sequence_parallel, use_distributed_optimizer=spec.distributed_optimizer,
        weipipe_grad_dtype="bf16" if spec.weipipe_grad_bytes == 2 else "fp32",
    )
    training = TrainingConfig(micro_batch_size=s.micro_batch_size, global_batch_size=spec.global_batch_size,
                              bf16=spec.compute_bytes == 2)
    fpdt = FPDTConfig()
    if spec.fpdt is not None:
        fpdt = FPDTConfig(enabled=True, chunk_size=spec.fpdt.chunk_size, offload=spec.fpdt.offload)
    data = DataConfig(seq_length=s.seq_length, mock_data=True, vocab_size=s.vocab_size)
    return PretrainConfig(model=model, parallel=parallel, training=training, data=data, fpdt=fpdt,
                          world_size=lay.world)


def spec_from_config(cfg: PretrainConfig, *, virtual_stages: int = 2, zero3: bool = False,
                     attention_impl: str = "flash", weight_pass: str = "stored",
                     offload_checkpoints: bool = False) -> RunSpec:
    """The RunSpec of a training configuration; the arguments are what training has no flag for.

    ``virtual_stages`` is the interleaved schedule's model chunks per rank when
    --num-layers-per-virtual-pipeline-stage is not given.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.training
    offload_checkpoints = offload_checkpoints or m.offload_layer_inputs  # the training flag of the same thing
    shape = m.shape(micro_batch_size=t.micro_batch_size, vocab_size=cfg.data.vocab_size or DEFAULT_VOCAB_SIZE)
    layout = Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                    cp=p.context_parallel_size, dp=cfg.data_parallel_size)
    if p.num_layers_per_virtual_pipeline_stage:
        virtual_stages = p.virtual_pipeline_size(m.num_layers)
    fpdt: Optional[FPDTSpec] = None
    if cfg.fpdt.enabled:
        fpdt = FPDTSpec(chunk_size=cfg.fpdt.chunk_size, offload=cfg.fpdt.offload,
                        offload_checkpoints=offload_checkpoints)
    return RunSpec(
        shape=shape, layout=layout, global_batch_size=t.global_batch_size, schedule=cfg.schedule_name,
        virtual_stages=virtual_stages, recompute=m.recompute_granularity == "full" or offload_checkpoints,
        compute_bytes=t.compute_bytes, weipipe_grad_bytes=2 if p.weipipe_grad_dtype == "bf16" else 4,
        sequence_parallel=p.sequence_parallel, distributed_optimizer=p.use_distributed_optimizer, zero3=zero3,
        torch_fsdp2=p.use_torch_fsdp2, offload_layer_inputs=offload_checkpoints, attention_impl=attention_impl,
        dropout=m.hidden_dropout > 0 or m.attention_dropout > 0, fpdt=fpdt,
        weight_pass=weight_pass,
    )


def for_schedule(cfg: PretrainConfig, name: str) -> PretrainConfig:
    """``cfg`` resolved for one of the schedules the simulator compares."""
    if name != "interleaved" and cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        cfg = replace(cfg, parallel=replace(cfg.parallel, num_layers_per_virtual_pipeline_stage=None))
    if name == "fsdp":  # the same GPUs as data-parallel ranks, no pipeline
        p = cfg.parallel
        cfg = replace(cfg, parallel=replace(p, pipeline_model_parallel_size=1, pipeline_schedule=None))
    return cfg.with_derived_defaults(BASELINES.get(name, name))
