"""Megatron's own schedules (no pipelining, 1F1B, interleaved 1F1B), reused from megatron-core.

The schedule functions are megatron-core's; this module only builds the stage models
the way Megatron-LM's ``get_model`` does and wraps them in megatron-core's DDP.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.schedules.gpt.base import ForwardStep, ModelProvider, StepResult, TrainSchedule


def ddp_config(cfg: PretrainConfig) -> DistributedDataParallelConfig:
    p = cfg.parallel
    return DistributedDataParallelConfig(
        # fp32 gradient buffers and reduction unless --grad-reduce-in-bf16 (or --fp16 without
        # --accumulate-allreduce-grads-in-fp32): Megatron-LM's rule, TrainingConfig.grad_reduce_in_fp32
        grad_reduce_in_fp32=cfg.training.grad_reduce_in_fp32,
        overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_param_gather=p.overlap_param_gather,
        # Megatron-LM: with virtual stages the schedule starts each chunk's gathers (param_sync_func)
        align_param_gather=p.overlap_param_gather and p.virtual_pipeline_size(cfg.model.num_layers) is not None,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        check_for_nan_in_grad=False,  # checked by the training loop, with a clearer message
        fp8_param_gather=cfg.fp8.fp8_param_gather,
        nccl_ub=cfg.parallel.use_nccl_ub,
        disable_symmetric_registration=cfg.parallel.disable_symmetric_registration,
        bucket_size=None,
    )


def finalize_summed_grads(model, num_tokens=None, *args, **kwargs):
    """megatron-core's finalize_model_grads without its per-token division.

    Under --calculate-per-token-loss megatron-core's schedules pass this rank's token count;
    its finalize_model_grads would reduce the count over pipeline and data-parallel ranks
    and divide (0.16 reads the count back to the host to do so, inside forward_backward).
    The global count is already in the iteration's one reduction (training/loss_reduction.py),
    after which the training step divides every schedule's gradients the same way.
    """
    return finalize_model_grads(model, None, *args, **kwargs)


def wrap_ddp(cfg: PretrainConfig, chunks: list[torch.nn.Module]) -> list[DistributedDataParallel]:
    conf = ddp_config(cfg)
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=conf,
                module=chunk,
                # Megatron-LM: only the first virtual chunk gets buckets, overlap needs the rest.
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def _one_or_list(funcs: list):
    """What megatron-core's schedules take for one model chunk, or one per chunk."""
    return funcs[0] if len(funcs) == 1 else funcs


class MegatronSchedule(TrainSchedule):
    """none, 1f1b and interleaved: megatron-core's forward_backward function for the
    parallel layout (its start-up rules are check/rules.py's check_no_pipelining,
    check_1f1b and check_interleaved)."""

    def build_model(self, model_provider: ModelProvider) -> list[torch.nn.Module]:
        vpp = self.cfg.parallel.virtual_pipeline_size(self.cfg.model.num_layers)
        chunks = []
        if vpp is None:
            chunks.append(
                model_provider(
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                )
            )
        else:
            for v in range(vpp):
                chunks.append(
                    model_provider(
                        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                        vp_stage=v,
                    )
                )
        config = chunks[0].config
        if self.cfg.parallel.use_torch_fsdp2:
            from megatron_weipipe.model.fsdp import wrap_fsdp

            dtype = torch.bfloat16 if self.cfg.training.bf16 else torch.float32
            reduce_dtype = torch.float32 if self.cfg.training.grad_reduce_in_fp32 else dtype
            offload = self.cfg.offload.fsdp_offload_policy(self.ctx.platform.pin_memory)
            self.model_chunks = wrap_fsdp(self.ctx, chunks, ddp_config(self.cfg), self.cfg.parallel,
                                          compute_dtype=dtype, reduce_dtype=reduce_dtype, offload_policy=offload)
            config.finalize_model_grads_func = None  # FSDP reduce-scatters in backward
            if self.cfg.parallel.torch_fsdp2_no_grad_sync_per_microbatch:
                config.no_sync_func = _one_or_list([m.no_sync for m in self.model_chunks])
            return self.model_chunks
        self.model_chunks = wrap_ddp(self.cfg, chunks)
        config.finalize_model_grads_func = finalize_summed_grads if config.calculate_per_token_loss else \
            finalize_model_grads
        if self.cfg.parallel.overlap_grad_reduce:
            config.no_sync_func = _one_or_list([m.no_sync for m in self.model_chunks])
            config.grad_sync_func = _one_or_list([m.start_grad_sync for m in self.model_chunks])
        if self.cfg.parallel.overlap_param_gather:
            from megatron_weipipe.schedules.gpt.param_gather import DeferredParamGather

            if self.model_chunks[0].ddp_config.align_param_gather:
                config.param_sync_func = _one_or_list([m.start_param_sync for m in self.model_chunks])
            self.param_gather = DeferredParamGather(self.model_chunks, config)
        return self.model_chunks

    def forward_backward(
        self,
        forward_step: ForwardStep,
        microbatches: list[dict],
        forward_only: bool = False,
    ) -> StepResult:
        fb = get_forward_backward_func()
        chunks = self.model_chunks
        # Each virtual chunk reads the same microbatches at its own pace (first: tokens, last: labels).
        iterators = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
        traced = contextlib.nullcontext() if forward_only or self.tracer is None else self._traced()
        with self.ctx.bytes.scope("activations"), traced:
            losses = fb(
                forward_step_func=forward_step,
                data_iterator=iterators,
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(microbatches),
                # megatron-core divides by the context-parallel size itself.
                seq_length=self.cfg.model.seq_length,
                micro_batch_size=self.cfg.training.micro_batch_size,
                forward_only=forward_only,
            )
        has_loss = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        return StepResult(losses=list(losses) if has_loss else [], has_loss=has_loss)

    @contextlib.contextmanager
    def _traced(self):
        """Time megatron-core's per-microbatch forward_step and backward_step (module
        functions its schedules look up at call time) inside one iteration event;
        everything else in the iteration (point-to-point waits included) is idle."""
        from megatron.core.pipeline_parallel import schedules

        tracer = self.tracer
        fwd, bwd = schedules.forward_step, schedules.backward_step

        def forward_step(*args, **kwargs):
            with tracer.span("forward", "compute"):
                return fwd(*args, **kwargs)

        def backward_step(*args, **kwargs):
            with tracer.span("backward", "compute"):
                return bwd(*args, **kwargs)

        schedules.forward_step, schedules.backward_step = forward_step, backward_step
        try:
            with self.trace_iteration():
                yield
        finally:
            schedules.forward_step, schedules.backward_step = fwd, bwd
