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

It also names the host memory a GPU host would use (``residency.host_buffer``, which the
dry run counts as host bytes): the fp32 copies, their gradient buffers and Adam state of
the first ``offload_fraction`` of the parameters (megatron-core's greedy split, by element
count), marked once their last piece exists, after the first step.
"""

from __future__ import annotations

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megatron_weipipe import residency


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
        self._host_marked = False

    def step(self, closure=None):
        super().step(closure)
        if not self._host_marked:
            self._mark_host_state()

    def _mark_host_state(self) -> None:
        self._host_marked = True
        params = [p for g in self.param_groups for p in g["params"]]
        threshold, offloaded = self.offload_fraction * sum(p.numel() for p in params), 0
        for param in params:
            if offloaded >= threshold:
                break
            offloaded += param.numel()
            inner = self.param_to_inner_param[param]
            state = [v for v in self.state.get(param, {}).values() if hasattr(v, "untyped_storage")]
            for t in (inner, self.cpu_copy_map_grad.get(inner), *state):
                if t is not None and t is not param:
                    residency.host_buffer(t)


def use_on_this_host(cuda: bool) -> None:
    """Make megatron-core build the subclass where there is no GPU (its builder and the
    distributed optimizer name the class themselves)."""
    if cuda:
        return
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    optimizer.HybridDeviceOptimizer = HostHybridDeviceOptimizer
    distrib_optimizer.HybridDeviceOptimizer = HostHybridDeviceOptimizer
