"""The L2 norm of all parameters (``--log-params-norm``), as Megatron-LM's ``calc_params_l2_norm``.

The parameters are the optimizer's own (the fp32 master copies where there are any, the
shards under the distributed optimizer and FSDP2), filtered and reduced exactly as
megatron-core filters and reduces them for the gradient norm: shared copies (the tied output
weight of the last stage, WeiPipe's replicated embedding, final norm and head on ring ranks
> 0) and tensor-parallel duplicates are left out, and the squares are summed over the
optimizer's gradient-statistics group. So a parameter counts once wherever its gradient does.
The norm stays on the device until one read-back; the loop asks for it on log lines only.
"""

from __future__ import annotations

import math

import torch


def _norm_tensors(optimizer) -> list[torch.Tensor]:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    tp_group = getattr(optimizer, "tp_group", None)
    return [p.detach() for p in optimizer.get_parameters()
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group)]


def _group_norm(optimizers: list, group) -> float:
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    tensors = [t for o in optimizers for t in _norm_tensors(o)]
    return get_grad_norm_fp32(tensors, grad_stats_parallel_group=group)


@torch.no_grad()
def params_l2_norm(optimizer) -> float:
    """The norm over every rank of the run's model; the same value on every rank of a replica."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    groups = [o.get_grad_stats_parallel_group() for o in optimizers]
    if all(g == groups[0] for g in groups):  # one reduction, one read-back
        return _group_norm(optimizers, groups[0])
    return math.sqrt(sum(_group_norm([o], g) ** 2 for o, g in zip(optimizers, groups)))
