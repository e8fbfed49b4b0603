"""megatron-core's linear layers behind the runtime's deferred weight gradients.

Each ColumnParallelLinear / RowParallelLinear of the chunk template (QKV, projection,
FC1, FC2) gets an instance-level `_forward_impl` that, while the runtime has a
deferring scope open (a forward whose backward is split), runs `wgrad.deferred_linear`:
input gradient (all-reduced over tensor parallelism where the column-parallel layer
asks for it) and bias gradient in the input step, the weight GEMM in the weight step.
Anything else (no scope, frozen weight, sequence parallelism, gradient-accumulation
fusion) takes megatron-core's own path, which computes the weight gradient at once.
With Transformer Engine layers, megatron-core's `delay_wgrad_compute` / `backward_dw()`
would be the item behind the same store; only this local path is implemented.
"""

from __future__ import annotations

from torch import nn

from megatron_weipipe.mcore_versions import NEUTRAL_LINEAR_KWARGS
from megatron_weipipe.schedules.runtime import wgrad


def install(template: nn.Module) -> list[str]:
    """Route the template's parallel linear layers through the store; returns the
    weight names that can be deferred."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    names = []
    for prefix, module in template.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
            name = f"{prefix}.weight" if prefix else "weight"
            module._forward_impl = _impl(module, name)
            names.append(name)
    return names


def _impl(module: nn.Module, name: str):
    original = type(module)._forward_impl.__get__(module)

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                     **kwargs):
        extra = {k: v for k, v in kwargs.items() if NEUTRAL_LINEAR_KWARGS.get(k, object()) != v}
        plain = (not wgrad.active() or not weight.requires_grad or sequence_parallel or gradient_accumulation_fusion
                 or grad_output_buffer is not None or extra)
        if plain:
            return original(input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                            tp_group=tp_group, **kwargs)
        return wgrad.deferred_linear(input, weight, bias, name, allreduce_dgrad=allreduce_dgrad, tp_group=tp_group)

    return forward_impl
