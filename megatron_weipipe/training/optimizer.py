"""megatron-core's optimizer (fp32 master weights, clipping) and LR/WD scheduler from our config."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.platform import detect_platform


def optimizer_config(cfg: PretrainConfig, pin_memory: bool = False) -> OptimizerConfig:
    """``pin_memory``: the platform pins host buffers (a CUDA host); --optimizer-cpu-offload's
    host copies are pinned only then."""
    t = cfg.training
    # Under --use-torch-fsdp2 the (sharded) parameters are fp32 and are the master weights
    # themselves (docs/how-it-works/fsdp.md): megatron-core's fp32 optimizer, no copy, no loss scale.
    half = not cfg.parallel.use_torch_fsdp2
    offload = cfg.offload.optimizer_config_kwargs(fsdp2=cfg.parallel.use_torch_fsdp2, pin_memory=pin_memory)
    precision_aware = offload.pop("use_precision_aware_optimizer")
    config = OptimizerConfig(
        optimizer=t.optimizer,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        sgd_momentum=t.sgd_momentum,
        # megatron-core gives the is_embedding_or_output_parameter weights their own group and schedule
        decoupled_lr=t.decoupled_lr,
        decoupled_min_lr=t.decoupled_min_lr,
        clip_grad=t.clip_grad,
        bf16=t.bf16 and half,
        fp16=t.fp16 and half,
        params_dtype=torch.bfloat16 if t.bf16 and half else (torch.float16 if t.fp16 and half else torch.float32),
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,  # as DDP's (megatron-core reads both)
        initial_loss_scale=2**16,
        log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
        use_precision_aware_optimizer=precision_aware and _transformer_engine_version() is not None,
        **offload,
    )
    if precision_aware and not config.use_precision_aware_optimizer:
        # megatron-core's __post_init__ compares the Transformer Engine version, which fails
        # where TE is absent; the hybrid-device optimizer needs no TE: set what it would set.
        config.use_precision_aware_optimizer = True
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        config.store_param_remainders = False  # TE older than 2.1 (here: none) keeps none
    return config


def _transformer_engine_version():
    from megatron.core.utils import get_te_version

    return get_te_version()


def build_optimizer(cfg: PretrainConfig, model_chunks, pin_memory: bool = False):
    """Megatron-LM's parameter groups: no weight decay on biases and 1-D weights, and
    --decoupled-lr's group of the embedding and output layer."""
    use_device_grad_norm(host_grads=cfg.parallel.use_torch_fsdp2 and cfg.offload.optimizer_cpu_offload)
    config = optimizer_config(cfg, pin_memory)
    if config.optimizer_cpu_offload:
        from megatron_weipipe.training.host_hybrid_optimizer import use_on_this_host

        use_on_this_host(detect_platform().is_cuda)
    optimizer = get_megatron_optimizer(config, model_chunks, config_overrides=get_standard_config_overrides(config),
                                       use_gloo_process_groups=False)
    if config.optimizer_cpu_offload:
        # megatron-core builds a hybrid-device optimizer over the whole model's parameters and
        # replaces it with one over this rank's shard; the first one's fp32 copies of every
        # parameter live on in a reference cycle (its hooks) until the cyclic collector runs
        import gc

        gc.collect()
    if cfg.parallel.use_torch_fsdp2 and cfg.offload.optimizer_cpu_offload:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            _name_host_state(opt.optimizer)
    return optimizer


def _name_host_state(inner: torch.optim.Optimizer) -> None:
    """FSDP2's CPUOffloadPolicy: Adam's moments follow their host parameters; named as host
    memory (``residency.host_buffer``) after the first step creates them."""
    from megatron_weipipe import residency

    def mark(opt, args, kwargs):
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    residency.host_buffer(t.to_local() if hasattr(t, "to_local") else t)
        handle.remove()

    handle = inner.register_step_post_hook(mark)


def _device_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's ``multi_tensor_l2norm`` contract, on the device: the same per-tensor
    norms and their norm, with no value read back. Gradients in host memory (FSDP2 under
    --optimizer-cpu-offload) are normed where they are and the norm joins ``noop_flag`` on
    the device, where megatron-core all-reduces it."""
    norms = torch.stack([torch.linalg.vector_norm(t) for t in tensor_lists[0]])
    total = torch.linalg.vector_norm(norms).float().reshape(1)
    if total.device != noop_flag.device:  # host gradients: their norm goes up, nothing comes down
        total = total.to(noop_flag.device, non_blocking=True)
    return total, None


def use_device_grad_norm(host_grads: bool = False) -> None:
    """Without Transformer Engine or apex, megatron-core's gradient norm falls back to
    ``local_multi_tensor_l2_norm``, which reads every parameter's norm back to the host
    (``torch.tensor(list_of_device_scalars)``): one GPU sync per parameter per iteration.
    Replace only that fallback; TE's and apex's fused kernels stay, unless the gradients
    live in host memory (``host_grads``), which their CUDA kernels cannot read."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if host_grads or getattr(clip_grads, "l2_norm_impl", None) is getattr(utils, "local_multi_tensor_l2_norm",
                                                                         object()):
        clip_grads.l2_norm_impl = _device_l2_norm


def clip_grads_by_norm(params, max_norm: float, total_norm: float, decoupled: bool) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` (the same coefficient, the same
    multiplication), which also takes gradients in host memory on a CUDA host (FSDP2 under
    --optimizer-cpu-offload: megatron-core's asserts a CUDA tensor there) and reads
    ``.decoupled_grad`` under --use-precision-aware-optimizer."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.utils import to_local_if_dtensor

    grads = [getattr(p, "decoupled_grad" if decoupled else "grad", None) for p in params]
    grads = [to_local_if_dtensor(g).detach() for g in grads if g is not None]
    if not (detect_platform().is_cuda and any(g.device.type == "cpu" for g in grads)):
        clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm, use_decoupled_grad=decoupled)
        return
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


WD_STEPS = "total number of weight decay iterations"  # megatron-core's name of wd_incr_steps


class ParamScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler; a schedule that differs from the checkpoint's is one line
    naming the two flags that settle it, not an assertion. The weight-decay ramp's length
    (--train-iters x batch in Megatron-LM) is compared only when the decay ramps, so a run
    extended with an explicit --lr-decay-iters resumes."""

    def _check_and_set(self, cls_value, sd_value, name):
        if name == WD_STEPS and self.start_wd == self.end_wd:
            return cls_value  # a constant weight decay: its ramp length changes nothing
        if not (self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler) \
                and cls_value != sd_value:
            raise ScheduleMismatch(f"the checkpoint's {name} is {sd_value} but these flags give {cls_value}: pass "
                                   "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule or "
                                   "--override-opt_param-scheduler to take the flags'")
        return super()._check_and_set(cls_value, sd_value, name)


class ScheduleMismatch(ValueError):
    """--load under a learning-rate schedule that differs from the checkpoint's."""


def build_scheduler(cfg: PretrainConfig, optimizer) -> OptimizerParamScheduler:
    """The schedule counted in samples, as Megatron-LM's get_optimizer_param_scheduler counts
    it: iteration-based lengths times the global batch, or --train-samples' own."""
    t = cfg.training
    warmup = t.lr_warmup_steps
    return ParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=t.lr_decay_steps,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.wd_incr_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler,
    )
