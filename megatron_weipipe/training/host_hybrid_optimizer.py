"""megatron-core's hybrid-device optimizer on a host without a GPU.

``HybridDeviceOptimizer`` copies each device parameter it offloads to a host buffer and
keeps the pair in two maps; the gradient goes to the host copy before the host step and
the updated copy comes back after it. A parameter that already lives in host memory is
put in a host optimizer but in neither map, so its first step fails (a KeyError). On a
CPU host every parameter lives there, standing in for a device tensor (platform.py's CPU
adapter), so this subclass enters those parameters in the maps too: each one then takes
the path a GPU parameter takes (its gradient copied into the optimizer's fp32 buffer, the
step, the update copied back and rounded to the weights' dtype), with host memory as the
"device". Installed only where CUDA is absent.
"""

from __future__ import annotations

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer


class HostHybridDeviceOptimizer(HybridDeviceOptimizer):
    """HybridDeviceOptimizer whose host-resident parameters count as offloaded ones."""

    def _init_sub_optimizers(self):
        super()._init_sub_optimizers()
        for group in self.cpu_param_groups:
            for inner in group["params"]:
                if inner in self.cpu_copys_map_gpu_param:
                    continue
                param = self.inner_param_to_orig_param[inner]
                self.cpu_copys_map_gpu_param[inner] = param
                self.gpu_params_map_cpu_copy[param] = inner


def use_on_this_host(cuda: bool) -> None:
    """Make megatron-core build the subclass where there is no GPU (its builder and the
    distributed optimizer name the class themselves)."""
    if cuda:
        return
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    optimizer.HybridDeviceOptimizer = HostHybridDeviceOptimizer
    distrib_optimizer.HybridDeviceOptimizer = HostHybridDeviceOptimizer
