"""What every pipeline schedule provides to the training loop."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.schedules import registry

# model_provider(pre_process, post_process, vp_stage) -> GPTModel, as in Megatron-LM.
ModelProvider = Callable[..., torch.nn.Module]
# forward_step(data_iterator, model) -> (output_tensor, loss_func), as in Megatron-LM.
ForwardStep = Callable[..., tuple]


@dataclass
class StepResult:
    """One iteration's forward/backward outcome on this rank."""

    losses: list[dict[str, torch.Tensor]]  # per microbatch, meaningful where has_loss
    has_loss: bool  # this rank computed the loss (last pipeline stage, or every WeiPipe rank)


class TrainSchedule(ABC):
    """A way to run forward and backward over a batch of microbatches.

    A schedule decides which model pieces live on this rank (``build_model``) and how
    microbatches, activations and weights move (``forward_backward``). The optimizer,
    checkpointing and logging see only ``model_chunks``; the keys of their sharded state
    dicts do not depend on the schedule, so checkpoints move between schedules.
    """

    def __init__(self, cfg: PretrainConfig, ctx: RunContext):
        self.cfg = cfg
        self.ctx = ctx  # process groups, platform, byte counter
        self.groups = ctx.groups
        self.name = registry.schedule_name(cfg)  # one class may serve several schedules
        self.model_chunks: list[torch.nn.Module] = []
        self.tracer = None  # per-action Chrome trace (--schedule-trace DIR)
        self.param_gather = None  # --overlap-param-gather: a DeferredParamGather (param_gather.py)
        trace_dir = getattr(cfg.logging, "schedule_trace", None)
        if trace_dir:
            import torch.distributed as dist

            from megatron_weipipe.schedules.runtime.trace import ActionTracer
            from megatron_weipipe.schedules.runtime.trace_clock import clock_for

            g = ctx.groups
            meta = {"pipeline_size": g.pp_size, "pipeline_rank": g.pp_rank, "data_parallel_rank": g.dp_rank,
                    "num_microbatches": cfg.num_microbatches,
                    "virtual_stages": cfg.parallel.virtual_pipeline_size(cfg.model.num_layers),
                    "device_type": ctx.platform.device_type}
            # CUDA events on a GPU (host time measures launches there), host time on a CPU host
            self.tracer = ActionTracer(trace_dir, dist.get_rank() if dist.is_initialized() else 0, self.name, meta,
                                       clock=clock_for(ctx.platform))

    def trace_iteration(self):
        """Around one training iteration's forward and backward (not the optimizer step)."""
        return self.tracer.iteration_span() if self.tracer is not None else contextlib.nullcontext()

    def trace_span(self, name: str):
        """Any other traced phase of the iteration (e.g. the optimizer step)."""
        return self.tracer.phase(name) if self.tracer is not None else contextlib.nullcontext()

    @classmethod
    def check_config(cls, cfg: PretrainConfig) -> None:
        """Raise ConfigError for flag combinations the configured schedule cannot run
        (its pure rules in check/rules.py, found through the registry)."""
        registry.check_config(cfg)

    @abstractmethod
    def build_model(self, model_provider: ModelProvider) -> list[torch.nn.Module]:
        ...

    @abstractmethod
    def forward_backward(
        self,
        forward_step: ForwardStep,
        microbatches: list[dict],
        forward_only: bool = False,
    ) -> StepResult:
        """Run every microbatch of one iteration (this data-parallel replica's share)."""

    def data_shard(self) -> tuple[int, int, int]:
        """(data rank, number of data ranks, microbatches per iteration at --global-batch-size)
        for this rank's loader.

        Megatron's schedules shard samples over data-parallel replicas; every stage of a
        pipeline reads the same microbatches.
        """
        return self.groups.dp_rank, self.groups.dp_size, self.local_microbatches(self.cfg.num_microbatches)

    def local_microbatches(self, num_microbatches: int) -> int:
        """This rank's microbatches of an iteration of ``num_microbatches`` per data-parallel
        replica (a batch-size ramp changes it between iterations)."""
        return num_microbatches

    def zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    def scale_gradients(self, factor: float) -> None:
        """Multiply this rank's reduced gradients by ``factor`` (--calculate-per-token-loss:
        1 / the global batch's loss tokens), as megatron-core's finalize_model_grads does:
        every model chunk's wrapper scales its own buffers."""
        for chunk in self.model_chunks:
            chunk.scale_gradients(factor)
