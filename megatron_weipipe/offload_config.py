"""Model state off the accelerator: Megatron-LM's ``--optimizer-cpu-offload`` and its companions.

Two forms, chosen by the data-parallel mode:

* ``--use-distributed-optimizer``: megatron-core's ``HybridDeviceOptimizer`` keeps the fp32
  master weights and the Adam state of ``--optimizer-offload-fraction`` of each rank's shard
  in host memory and steps them there; gradients go to the host and updated weights come
  back once per step. The compute weights and DDP's gradient buffers stay on the device.
* ``--use-torch-fsdp2``: FSDP2's ``CPUOffloadPolicy`` keeps every sharded parameter (the fp32
  masters), its gradient and therefore the optimizer state on the host; each unit's shard is
  copied to the device for its all-gather and its reduced gradient copied back, unit by unit.

Host buffers are pinned only where CUDA exists (``Platform.pin_memory``). The accounting of
what stays on the device and what sits on the host is simulator/host_state.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option


@dataclass
class OffloadConfig:
    optimizer_cpu_offload: bool = option(
        False, help="keep optimizer state in host memory: with --use-distributed-optimizer megatron-core's "
                    "hybrid-device optimizer (fp32 masters and Adam state of --optimizer-offload-fraction of the "
                    "shard, stepped on the host; needs --use-precision-aware-optimizer, as in Megatron-LM); with "
                    "--use-torch-fsdp2 FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state on the "
                    "host, copied to the device unit by unit)")
    optimizer_offload_fraction: float = option(
        1.0, help="with --optimizer-cpu-offload and --use-distributed-optimizer: the fraction of each rank's "
                  "optimizer shard kept and stepped on the host (FSDP2 offloads all of it)")
    use_precision_aware_optimizer: bool = option(
        False, help="megatron-core's precision-aware optimizer path (gradients handed to the optimizer as "
                    "decoupled fp32 main gradients); needs --use-distributed-optimizer and --optimizer adam, and "
                    "Transformer Engine's FusedAdam unless --optimizer-cpu-offload")
    overlap_cpu_optimizer_d2h_h2d: bool = option(
        False, help="with --optimizer-cpu-offload and --use-distributed-optimizer: one host optimizer per "
                    "parameter, its gradient copy, step and weight copy-back on side CUDA streams, overlapped")
    pin_cpu_grads: bool = option(True, flag="--no-pin-cpu-grads", inverted=True,
                                 help="do not page-lock the host copies of the gradients (CUDA hosts only pin)")
    pin_cpu_params: bool = option(True, flag="--no-pin-cpu-params", inverted=True,
                                  help="do not page-lock the host copies of the parameters (CUDA hosts only pin)")

    def validate(self, *, distributed_optimizer: bool, fsdp2: bool, optimizer: str, half: bool,
                 fp8_param_gather: bool, fp8_recipe: str) -> None:
        """Megatron-LM's and megatron-core's rules, and what FSDP2's policy cannot do."""
        require(0.0 <= self.optimizer_offload_fraction <= 1.0, "--optimizer-offload-fraction must be in [0, 1]")
        if self.use_precision_aware_optimizer:
            require(distributed_optimizer, "--use-precision-aware-optimizer needs --use-distributed-optimizer (as in "
                                           "megatron-core)")
            require(optimizer == "adam", "--use-precision-aware-optimizer needs --optimizer adam (as in megatron-core)")
        if not self.optimizer_cpu_offload:
            return
        require(distributed_optimizer or fsdp2,
                "--optimizer-cpu-offload needs --use-distributed-optimizer (megatron-core's hybrid-device optimizer) "
                "or --use-torch-fsdp2 (FSDP2's CPUOffloadPolicy)")
        if fsdp2:
            require(self.optimizer_offload_fraction == 1.0,
                    "--optimizer-offload-fraction below 1 needs --use-distributed-optimizer: FSDP2's "
                    "CPUOffloadPolicy keeps every shard on the host")
            require(not self.overlap_cpu_optimizer_d2h_h2d,
                    "--overlap-cpu-optimizer-d2h-h2d is the hybrid-device optimizer's (--use-distributed-optimizer); "
                    "FSDP2 copies its shards on its own streams")
            return
        require(self.use_precision_aware_optimizer,
                "--optimizer-cpu-offload with --use-distributed-optimizer needs --use-precision-aware-optimizer "
                "(as in Megatron-LM: the hybrid-device optimizer takes that path's decoupled gradients)")
        require(half, "--optimizer-cpu-offload with --use-distributed-optimizer needs --bf16 or --fp16 (megatron-core's "
                      "hybrid-device optimizer takes the 16-bit weights' shards; fp32 weights' shards are views it "
                      "cannot optimize); in fp32 use --use-torch-fsdp2")
        require(not fp8_param_gather or fp8_recipe == "delayed",
                "--optimizer-cpu-offload with --fp8-param-gather needs --fp8-recipe delayed (as in Megatron-LM)")

    def host_problem(self, transformer_engine: bool) -> Optional[str]:
        """Why this host cannot run these flags (None: it can)."""
        if self.use_precision_aware_optimizer and not self.optimizer_cpu_offload and not transformer_engine:
            return ("--use-precision-aware-optimizer without --optimizer-cpu-offload needs Transformer Engine's "
                    "FusedAdam (as in megatron-core); this host has no Transformer Engine")
        return None

    def optimizer_config_kwargs(self, *, fsdp2: bool, pin_memory: bool) -> dict:
        """megatron-core OptimizerConfig fields: its hybrid-device optimizer in the distributed-optimizer
        form only (under FSDP2 the parameters themselves are on the host). Pinning only where the
        platform pins."""
        return dict(
            optimizer_cpu_offload=self.optimizer_cpu_offload and not fsdp2,
            optimizer_offload_fraction=self.optimizer_offload_fraction,
            use_precision_aware_optimizer=self.use_precision_aware_optimizer,
            overlap_cpu_optimizer_d2h_h2d=self.overlap_cpu_optimizer_d2h_h2d,
            pin_cpu_grads=self.pin_cpu_grads and pin_memory,
            pin_cpu_params=self.pin_cpu_params and pin_memory,
        )

    def fsdp_offload_policy(self, pin_memory: bool):
        """FSDP2's CPUOffloadPolicy (None: shards stay on the device)."""
        if not self.optimizer_cpu_offload:
            return None
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=pin_memory and self.pin_cpu_params and self.pin_cpu_grads)
