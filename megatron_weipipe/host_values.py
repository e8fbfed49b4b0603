"""Python numbers across ranks: the one rule for host values in collectives.

NCCL serves device tensors only: a host tensor handed to an NCCL collective raises "No
backend type associated with device type cpu". gloo takes anything, so a CPU run cannot
tell. The rule: **every collective's tensors live on the device its group's backend
serves** (``Platform.collective_device``: the current CUDA device under NCCL, the CPU
under gloo). Host values (loss sums, counts, flags) cross ranks as one small tensor made
there, through ``all_reduce_values``, and come back with one ``.tolist()``: the single
host sync of the exchange. Values that are already on the device (per-microbatch losses)
are stacked there, never read back one by one.

Object collectives (``all_gather_object``, ``broadcast_object_list``) are exempt: torch
moves their pickles to the current CUDA device itself under NCCL.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist

from megatron_weipipe.platform import Platform

Value = Union[float, int, bool, torch.Tensor]


def values_tensor(values: Sequence[Value], device: torch.device, dtype=torch.float64) -> torch.Tensor:
    """``values`` as one 1-D tensor on ``device`` without a host sync.

    Device scalars are stacked where they are; host numbers are copied in one
    non-blocking copy from a pinned buffer (a pageable host-to-device copy would wait for
    the device to drain first).
    """
    floats = [float(v) for v in values if not isinstance(v, torch.Tensor)]
    host = torch.tensor(floats, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    parts, it = [], iter(host)
    for v in values:
        parts.append(v.detach().reshape(()).to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else next(it))
    return torch.stack(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


def all_reduce_values(values: Sequence[Value], platform: Platform, group=None,
                      op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce host numbers and device scalars over ``group``; one host sync, at the end."""
    if not values:
        return []
    t = values_tensor(values, platform.collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()
