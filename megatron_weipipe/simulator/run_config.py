"""A simulated run and the training run it stands for, both ways.

The simulator's flags are pretrain_gpt.py's own (plus hardware and what-if options), so
a run description comes from the same ``PretrainConfig`` and is checked by the same
rules (the configs' and the schedule's), never by a second copy of them.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Optional

from megatron_weipipe.config import ModelConfig, ParallelConfig, PretrainConfig, TrainingConfig
from megatron_weipipe.data.config import DataConfig
from megatron_weipipe.fpdt.config import FPDTConfig
from megatron_weipipe.shape import ModelShape

from .layout import Layout

if TYPE_CHECKING:
    from .fpdt import FPDTSpec
    from .project import RunSpec

DEFAULT_VOCAB_SIZE = 32000  # when --vocab-size is not given (the simulator has no tokenizer)
_SHAPE_FIELDS = {f.name for f in fields(ModelShape)} & {f.name for f in fields(ModelConfig)}


def spec_to_config(spec: "RunSpec") -> PretrainConfig:
    """The training configuration a RunSpec simulates (validated with the training rules)."""
    s, lay = spec.shape, spec.layout
    long_context = lay.cp > 1 or spec.fpdt is not None
    model = ModelConfig(
        **{name: getattr(s, name) for name in _SHAPE_FIELDS},
        group_query_attention=s.num_query_groups is not None,
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
        num_layers_per_virtual_pipeline_stage=vpp, pipeline_schedule=spec.schedule,
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
                     offload_checkpoints: bool = False) -> "RunSpec":
    """The RunSpec of a training configuration; the arguments are what training has no flag for.

    ``virtual_stages`` is the interleaved schedule's model chunks per rank when
    --num-layers-per-virtual-pipeline-stage is not given.
    """
    from .fpdt import FPDTSpec
    from .project import RunSpec

    m, p, t = cfg.model, cfg.parallel, cfg.training
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
        attention_impl=attention_impl, dropout=m.hidden_dropout > 0 or m.attention_dropout > 0, fpdt=fpdt,
        weight_pass=weight_pass,
    )


def for_schedule(cfg: PretrainConfig, name: str) -> PretrainConfig:
    """``cfg`` resolved for one of the schedules the simulator compares."""
    if name != "interleaved" and cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        cfg = replace(cfg, parallel=replace(cfg.parallel, num_layers_per_virtual_pipeline_stage=None))
    return cfg.with_derived_defaults(name)
