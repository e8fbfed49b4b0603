"""What one simulated run is (``RunSpec``), and the training run it stands for, both ways.

The simulator's flags are pretrain_gpt.py's own (plus hardware and what-if options), so
a run description comes from the same ``PretrainConfig`` and is checked by the same
rules (the configs' and the schedule's), never by a second copy of them. A RunSpec made
from a configuration keeps it (``config``): the fields the simulator models are the
spec's own and written back over it, every other field the rules read is carried as it
was given. Which schedule is what (a pipeline, virtual stages, a baseline and the
trained schedule whose rules it obeys) is the registry's (schedules/registry.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Optional

from megatron_weipipe.arguments import check_config
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.weight_pass import WeightPass
from megatron_weipipe.fpdt.config import FPDTConfig
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Action, Flow, Schedule
from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.shape import ModelShape

from megatron_weipipe.errors import require_simulable
from .fpdt import FPDTSpec
from .sharding import FsdpSharding, sharding_from
from megatron_weipipe.simulator.rank_order import Layout

DEFAULT_VOCAB_SIZE = 32000  # when --vocab-size is not given (the simulator has no tokenizer)
DEFAULT_DROPOUT = 0.1  # the trainer's default --hidden-dropout / --attention-dropout


@dataclass(frozen=True)
class RunSpec:
    shape: ModelShape
    layout: Layout
    global_batch_size: int
    schedule: str
    virtual_stages: int = 2  # interleaved: model chunks per rank
    recompute: bool = False  # full activation recomputation
    recompute_modules: tuple[str, ...] = ()  # selective recomputation: --recompute-modules (core_attn, mlp, layernorm)
    compute_bytes: int = 2  # bf16 weights and activations (4 for the fp32 CPU runs)
    weipipe_grad_bytes: int = 4  # the gradient flow (--weipipe-grad-dtype)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    zero3: bool = False  # DeepSpeed ZeRO-3 model state (bf16 weights and grads, fp32 Adam), all sharded
    # --use-torch-fsdp2: fp32 weights, grads and Adam moments sharded over data x context
    # parallel ranks; one unit (a layer, or the root's embedding and output layer) gathered
    # in the compute dtype at a time
    torch_fsdp2: bool = False
    fsdp: FsdpSharding = FsdpSharding()  # the FSDP baseline's sharding: HSDP replicas, FSDP2's options
    offload_layer_inputs: bool = False  # --offload-layer-inputs: recompute's kept inputs on the host
    attention_impl: str = "flash"  # "flash" (TE layers), "unfused" (local layers), "unfused+flash" (local, fused core)
    dropout: bool = True
    fpdt: Optional[FPDTSpec] = None
    lookahead: int = 1
    weight_pass: str = WeightPass.STORED  # WeiPipe's split backward: activations freed at I (stored) or at W
    kernel_efficiency: float = 1.0  # compute speed of this schedule's kernels relative to the cost model
    # the training configuration this spec was made from (spec_from_config): what the spec
    # does not model keeps its values there when the rules check the spec (spec_to_config)
    config: Optional[PretrainConfig] = field(default=None, compare=False, repr=False)

    @property
    def entry(self) -> registry.ScheduleEntry:
        """The registry's facts of the simulated schedule (a trained one or a baseline)."""
        found = registry.simulated(self.schedule)
        require_simulable(found is not None,
                          f"--schedules: {self.schedule!r} is unknown; choose from {', '.join(registry.simulated_names())}")
        return found

    @property
    def training_schedule(self) -> str:
        """The schedule whose training rules apply (a baseline's nearest trained schedule)."""
        return self.entry.trained_as or self.schedule

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.shape.micro_batch_size * self.layout.dp)

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards its state over: the data x context parallel
        ranks of one of --num-distributed-optimizer-instances groups (carried in ``config``)."""
        instances = self.config.parallel.num_distributed_optimizer_instances if self.config is not None else 1
        return self.layout.dp * self.layout.cp // instances

    @property
    def is_weipipe(self) -> bool:
        return registry.training_entry(self.schedule).is_weipipe

    @property
    def recompute_share(self) -> float:
        """Of a layer's forward, what its backward runs again: all of it under full
        recomputation; under selective, by FLOPs, the core attention's share (core_attn) and
        the MLP GEMMs' (mlp); the norms' elementwise work counts as nothing (layernorm)."""
        if self.recompute:
            return 1.0
        s = self.shape
        mlp = 2.0 * s.tokens * s.hidden_size * s.ffn * (3 if s.swiglu else 2)
        parts = {"core_attn": s.attention_flops(), "mlp": mlp}
        return sum(parts.get(m, 0.0) for m in self.recompute_modules) / (s.layer_gemm_flops() + s.attention_flops())

    @property
    def has_virtual_stages(self) -> bool:
        return registry.training_entry(self.schedule).virtual_stages

    @property
    def stages(self) -> int:
        """Model chunks in the pipeline (P, or P x V with virtual stages)."""
        return self.layout.pp * (self.virtual_stages if self.has_virtual_stages else 1)

    @property
    def layers_per_chunk(self) -> int:
        return self.shape.num_layers // self.stages

    def validate(self) -> "RunSpec":
        """The training rules of the run this simulates, then what the simulator itself needs."""
        P, L = self.layout.pp, self.shape.num_layers
        e = self.entry
        require_simulable(self.kernel_efficiency > 0, f"--kernel-efficiency of {self.schedule} must be positive")
        require_simulable(self.global_batch_size > 0, "--global-batch-size must be positive")
        require_simulable(not e.pipelined or P > 1,
                          f"schedule {self.schedule} needs --pipeline-model-parallel-size >= 2")
        if self.has_virtual_stages:
            V = self.virtual_stages
            require_simulable(V >= 2 and L % (P * V) == 0,
                              f"{self.schedule} needs --num-layers ({L}) divisible by pipeline size x virtual "
                              f"stages ({P} x {V})")
        cfg = spec_to_config(self)
        check_config(cfg, check_data=False)
        require_simulable(not cfg.parallel.megatron_context_parallel,
                          f"the simulator models this package's context parallelism (--cp-comm-type a2a: Ulysses/FPDT), "
                          f"not megatron-core's --cp-comm-type {' '.join(cfg.parallel.cp_comm_type)}")
        return self

    def build_schedule(self, zb_costs: Optional[tuple[float, float, float]] = None) -> Schedule:
        """The action lists; ``zb_costs``: (F, I, W) of one stage, which a costed timeline's
        order (zb-h1's) is built for."""
        e = self.entry
        if e.replayed_as is not None:
            return replace(self, schedule=e.replayed_as).build_schedule(zb_costs)
        V = self.virtual_stages if e.virtual_stages else 1
        return _built_schedule(self.schedule, self.layout.pp, self.num_microbatches, V,
                               zb_costs if e.costed_timeline is not None else None)

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


@functools.lru_cache(maxsize=128)
def _built_schedule(name: str, P: int, N: int, V: int, zb_costs: Optional[tuple[float, float, float]]) -> Schedule:
    """A schedule's action lists, a function of these sizes alone (a Schedule is frozen, so
    runs of one schedule and size share them: tools/plan.py times hundreds of runs)."""
    e = registry.simulated(name)
    if e.compute_plan is not None:
        return generate(name, P, N // P)
    if e.costed_timeline is not None:
        return registry.load(e.costed_timeline)(P, N, zb_costs or (1.0, 1.0, 1.0))
    return registry.load(e.timeline)(name, P, N, V)


def _has_dropout(m) -> bool:
    return m.hidden_dropout > 0 or m.attention_dropout > 0


def _model_config(spec: RunSpec, base: PretrainConfig, kept: bool):
    """The model section: the spec's shape, recomputation, dropout and layer-input offload
    over ``base``'s; a field the spec reduces to a yes/no (dropout, recomputation) keeps
    ``base``'s value where the spec agrees with it (``kept``: base is the spec's own config)."""
    s, m = spec.shape, base.model
    own = {name: getattr(s, name) for name in m.shape_fields()}
    if not (kept and spec.dropout == _has_dropout(m)):
        long_context = spec.layout.cp > 1 or spec.fpdt is not None
        p = DEFAULT_DROPOUT if spec.dropout else 0.0
        own.update(hidden_dropout=p, attention_dropout=0.0 if long_context else p)
    if not (kept and spec.recompute == (m.recompute_granularity == "full")
            and spec.recompute_modules == m.selective_modules):
        granularity = "full" if spec.recompute else ("selective" if spec.recompute_modules else None)
        own.update(recompute_granularity=granularity, recompute_method="uniform" if spec.recompute else None,
                   recompute_num_layers=None, recompute_activations=False,
                   recompute_modules=list(spec.recompute_modules) if granularity == "selective" else None)
    gqa = m.group_query_attention if kept else s.num_query_groups is not None
    return replace(m, **own, group_query_attention=gqa, offload_layer_inputs=spec.offload_layer_inputs)


def _parallel_config(spec: RunSpec, base: PretrainConfig):
    lay = spec.layout
    vpp = spec.shape.num_layers // (lay.pp * spec.virtual_stages) if spec.has_virtual_stages else None
    return replace(
        base.parallel, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        context_parallel_size=lay.cp, num_layers_per_virtual_pipeline_stage=vpp,
        pipeline_schedule=spec.training_schedule, sequence_parallel=spec.sequence_parallel,
        use_distributed_optimizer=spec.distributed_optimizer, use_torch_fsdp2=spec.torch_fsdp2,
        weipipe_grad_dtype="bf16" if spec.weipipe_grad_bytes == 2 else "fp32",
    )


def _training_config(spec: RunSpec, base: PretrainConfig):
    t = base.training
    precision = {}
    if spec.compute_bytes != t.compute_bytes:  # else --bf16 / --fp16 as given
        precision = dict(bf16=spec.compute_bytes == 2, fp16=False)
    return replace(t, micro_batch_size=spec.shape.micro_batch_size, global_batch_size=spec.global_batch_size,
                   **precision)


def _fpdt_config(spec: RunSpec, base: PretrainConfig) -> FPDTConfig:
    if spec.fpdt is None:
        return replace(base.fpdt, enabled=False)
    return FPDTConfig(**{f.name: getattr(spec.fpdt, f.name) for f in fields(FPDTConfig)})


def spec_to_config(spec: RunSpec) -> PretrainConfig:
    """The training configuration a RunSpec simulates (validated with the training rules):
    the spec's ``config`` (or the defaults) with every field the spec models written over it."""
    kept = spec.config is not None
    base = spec.config or PretrainConfig()
    s = spec.shape
    vocab = base.data.vocab_size if kept and (base.data.vocab_size or DEFAULT_VOCAB_SIZE) == s.vocab_size \
        else s.vocab_size
    data = replace(base.data, seq_length=s.seq_length, vocab_size=vocab, mock_data=base.data.mock_data or not kept)
    return replace(base, model=_model_config(spec, base, kept), parallel=_parallel_config(spec, base),
                   training=_training_config(spec, base), data=data, fpdt=_fpdt_config(spec, base),
                   world_size=spec.layout.world)


def spec_from_config(cfg: PretrainConfig, *, virtual_stages: int = 2, zero3: bool = False,
                     attention_impl: str = "flash", weight_pass: str = WeightPass.STORED,
                     offload_checkpoints: bool = False) -> RunSpec:
    """The RunSpec of a training configuration; the arguments are what training has no flag for.

    ``virtual_stages`` is the model chunks per rank of a schedule with virtual stages when
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
        fpdt = FPDTSpec(**{f.name: getattr(cfg.fpdt, f.name) for f in fields(FPDTConfig)},
                        offload_checkpoints=offload_checkpoints)
    return RunSpec(  # at the final batch size (a ramp's or step schedule's last)
        shape=shape, layout=layout, global_batch_size=t.global_batch_size, schedule=cfg.schedule_name,
        virtual_stages=virtual_stages, recompute=m.recompute_granularity == "full" or offload_checkpoints,
        recompute_modules=() if offload_checkpoints else m.selective_modules,
        compute_bytes=t.compute_bytes, weipipe_grad_bytes=2 if p.weipipe_grad_dtype == "bf16" else 4,
        sequence_parallel=p.sequence_parallel, distributed_optimizer=p.use_distributed_optimizer, zero3=zero3,
        torch_fsdp2=p.use_torch_fsdp2, offload_layer_inputs=offload_checkpoints, attention_impl=attention_impl,
        dropout=_has_dropout(m), fpdt=fpdt, weight_pass=weight_pass, config=cfg, fsdp=sharding_from(cfg),
    )


def for_schedule(cfg: PretrainConfig, name: str) -> PretrainConfig:
    """``cfg`` resolved for one of the schedules the simulator compares."""
    e = registry.simulated(name)
    require_simulable(e is not None, f"--schedules: {name!r} is unknown; choose from {', '.join(registry.simulated_names())}")
    trained = registry.training_entry(name)
    if not trained.virtual_stages and cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        cfg = replace(cfg, parallel=replace(cfg.parallel, num_layers_per_virtual_pipeline_stage=None))
    if e.projection == registry.FSDP:  # the same GPUs as data-parallel ranks, no pipeline
        p = cfg.parallel
        cfg = replace(cfg, parallel=replace(p, pipeline_model_parallel_size=1, pipeline_schedule=None))
    if (cfg.parallel.context_parallel_size > 1 or cfg.fpdt.enabled) and cfg.model.attention_dropout > 0:
        # Ulysses / FPDT layers take no attention dropout (the trainer's rule): the run is
        # projected as the trainer would have to be given it
        cfg = replace(cfg, model=replace(cfg.model, attention_dropout=0.0))
    return cfg.with_derived_defaults(trained.name)
