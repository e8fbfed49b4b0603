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
                       microbatches: int, shards: int) -> Optional[tuple[float, float]]:
    """(host to device, device to host) bytes one rank moves per optimizer step (None: no
    offload); ``params``: the rank's parameters, unsharded."""
    if offload is None or not offload.optimizer_cpu_offload:
        return None
    if fsdp2:  # per microbatch: the fp32 shard in twice (forward, backward), the gradient shard out
        shard = params * FP32 / shards
        return microbatches * 2 * shard, microbatches * shard
    moved = offload.optimizer_offload_fraction * params / state.optimizer_shards
    return moved * compute_bytes, moved * FP32  # updated weights in, gradients out


def summary_line(spec, params: float, state: StateBytes, host_link, iteration_s: float) -> Optional[str]:
    """The simulator report's line: host bytes of the model state, the step's host traffic,
    and how long the host link takes for it against the iteration's compute."""
    offload = spec.config.offload if spec.config is not None else None
    traffic = host_traffic_bytes(params, state, offload, fsdp2=spec.torch_fsdp2, compute_bytes=spec.compute_bytes,
                                 microbatches=spec.num_microbatches, shards=state.param_shards)
    if traffic is None:
        return None
    seconds = max(traffic) / (host_link.bandwidth_gbs * 1e9)
    form = "FSDP2 CPUOffloadPolicy" if spec.torch_fsdp2 else "hybrid-device optimizer"
    return (f"model state offload ({form}): {params * state_split(state, offload, spec.torch_fsdp2).host / 1e9:.1f} "
            f"GB per rank on the host; per iteration {traffic[0] / 1e9:.1f} GB host to device and "
            f"{traffic[1] / 1e9:.1f} GB back, {seconds:.2f} s at {host_link.name} {host_link.bandwidth_gbs:g} GB/s "
            f"against a {iteration_s:.1f} s iteration ({seconds / iteration_s:.2%})")
