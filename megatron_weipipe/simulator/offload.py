"""Where --optimizer-cpu-offload puts the model state: bytes per parameter on the accelerator
and in host memory, and the host traffic of one step (offload_config.py says what each
form does).

- Distributed optimizer, megatron-core's hybrid-device optimizer: the compute weights and
  DDP's fp32 gradient buffer stay on the device; of each rank's optimizer shard, the first
  ``--optimizer-offload-fraction`` keeps its fp32 master and Adam moments on the host, with
  an fp32 host copy of its gradient. Per step the shard's gradients go to the host and the
  updated weights come back in the compute dtype.
- FSDP2 with CPUOffloadPolicy: every sharded fp32 parameter, its fp32 gradient and Adam's
  moments live on the host; the device keeps only what is gathered (a unit's weights in
  the compute dtype, counted as FSDP2's gathered bytes) and, for the unit being moved, its
  fp32 shard copied in and its reduced fp32 gradient shard on its way out. Per microbatch
  each unit's shard is copied to the device for each all-gather (forward, and again in
  backward after ``reshard_after_forward``) and its gradient shard copied back.

Pinned host buffers are counted at their size; torch's pinned allocator rounds each one
up to a power of two (residency.py), which this count leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.simulator.memory import StateBytes

FP32 = 4


@dataclass(frozen=True)
class StateSplit:
    """Bytes per parameter of the model state, by role on the device, and on the host."""

    parameters: float
    gradients: float
    optimizer_state: float
    host: float

    @property
    def device(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def state_split(state: StateBytes, offload=None, fsdp2: bool = False) -> StateSplit:
    """``offload``: the run's OffloadConfig (None or --optimizer-cpu-offload off: all on the device)."""
    param, grad = state.param / state.param_shards, state.grad / state.param_shards
    opt = state.optimizer / state.optimizer_shards
    if offload is None or not offload.optimizer_cpu_offload:
        return StateSplit(param, grad, opt, 0.0)
    if fsdp2:
        return StateSplit(0.0, 0.0, 0.0, param + grad + opt)
    f = offload.optimizer_offload_fraction
    return StateSplit(param, grad, (1 - f) * opt, f * (opt + FP32 / state.optimizer_shards))


def fsdp2_offload_transit_bytes(unit_params: float, shards: int) -> float:
    """FSDP2 under CPUOffloadPolicy: a unit's fp32 shard copied to the device for its
    all-gather and its reduced fp32 gradient shard before the copy back."""
    return 2 * unit_params * FP32 / shards


def host_traffic_bytes(params: float, state: StateBytes, offload, *, fsdp2: bool, compute_bytes: int,
                       microbatches: int, shards: int) -> Optional[float]:
    """Bytes one rank moves between host and device per optimizer step (None: no offload).
    ``params``: the rank's parameters (unsharded)."""
    if offload is None or not offload.optimizer_cpu_offload:
        return None
    if fsdp2:  # per microbatch: the shard in twice (forward, backward), the gradient shard out
        return microbatches * 3 * params * FP32 / shards
    f = offload.optimizer_offload_fraction
    return f * params / state.optimizer_shards * (FP32 + compute_bytes)  # gradients out, weights back
