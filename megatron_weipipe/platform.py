"""What differs between CUDA and CPU hosts, in one place.

megatron-core assumes a GPU: it creates tensors with ``device="cuda"``, asks
``torch.cuda.current_device()``, swaps CUDA RNG states, checks type strings such as
``'torch.cuda.FloatTensor'`` and synchronises CUDA streams. On a host without a GPU
``install_cpu_adapter()`` makes those calls land on the CPU instead, so the very same
megatron-core code (models, schedules, DDP, optimizer, checkpointing) runs on gloo
processes. It is applied only when no GPU is present and never changes a CUDA host.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_installed = False


@dataclass(frozen=True)
class Platform:
    """The device, process-group backend and defaults of this host."""

    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank) if self.is_cuda else torch.device("cpu")


def detect_platform() -> Platform:
    """CUDA + NCCL when a GPU is visible (and not disabled), otherwise CPU + gloo."""
    force_cpu = os.environ.get("MEGATRON_WEIPIPE_FORCE_CPU", "0") == "1"
    if torch.cuda.is_available() and not force_cpu:
        return Platform("cuda", "nccl")
    return Platform("cpu", "gloo")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how megatron passes torch.cuda.current_device().
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device arguments to the CPU and reports CPU tensors as CUDA types.

    Only arguments are rewritten; every op still runs the normal CPU kernel.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.pin_memory or func is torch.Tensor.record_stream:
            return args[0] if func is torch.Tensor.pin_memory else None
        if "pin_memory" in kwargs and kwargs["pin_memory"]:
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event on a CPU host: work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_get_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def install_cpu_adapter() -> None:
    """Make megatron-core's CUDA-only calls work on CPU tensors. Idempotent; no-op on GPU hosts."""
    global _installed
    if _installed or detect_platform().is_cuda:
        return
    _installed = True

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    # The CUDA generator becomes the CPU default generator (torch.manual_seed seeds it too).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None

    # megatron-core keeps its own copies of the CUDA RNG getters/setters.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state

    # The tracker's "CUDA" stream is the CPU generator here, saved and restored around each
    # fork, so the fork's check that the CPU state is untouched is expected to fire.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )

    # A global mode: megatron-core's device="cuda" literals are spread across many modules.
    _CudaToCpuMode().__enter__()
    log.info("no GPU visible: megatron-core CUDA calls redirected to the CPU (gloo backend)")


def cpu_adapter_installed() -> bool:
    return _installed
