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
import functools
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_installed = False


@dataclass(frozen=True)
class Platform:
    """The device, process-group backend and device rules of this host.

    Everything that differs between a CUDA host and a CPU host is asked here (and only
    here), so ``MEGATRON_WEIPIPE_FORCE_CPU=1`` or any future rule holds everywhere.
    """

    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    # None: look for the package; True/False: a stated capability (tests fake a TE host).
    transformer_engine: Optional[bool] = None
    # None: try importing the compiled softmax kernels; True/False: a stated capability.
    fused_softmax: Optional[bool] = None
    # None: ask the current CUDA device; (major, minor): a stated one (tests fake a Hopper host).
    capability: Optional[tuple] = None

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def pin_memory(self) -> bool:
        """Page-locked host buffers speed up copies to a GPU; on a CPU host they are pointless."""
        return self.is_cuda

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")

    def collective_device(self, group=None) -> torch.device:
        """Where a collective's tensors must live: NCCL serves CUDA tensors only, gloo host
        ones (megatron_weipipe/host_values.py states the rule)."""
        import torch.distributed as dist

        return self.current_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def device_count(self) -> int:
        """CUDA devices visible to this process (0 on a CPU host)."""
        return torch.cuda.device_count() if self.is_cuda else 0

    def compute_capability(self) -> tuple:
        """The current GPU's (major, minor) compute capability; (0, 0) on a CPU host."""
        if not self.is_cuda:
            return (0, 0)
        if self.capability is not None:
            return tuple(self.capability)
        return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))

    def transformer_engine_available(self) -> bool:
        import importlib.util

        if self.transformer_engine is not None:
            return self.is_cuda and self.transformer_engine
        return self.is_cuda and importlib.util.find_spec("transformer_engine") is not None

    def attention_backend(self, requested: str = "auto") -> str:
        """The core attention of megatron-core's local layers for a ``--attention-backend`` value.

        ``auto`` is ``flash`` on every host: torch's fused scaled-dot-product attention
        (memory linear in the sequence; on a GPU restricted to its flash, cuDNN and
        memory-efficient kernels, model/sdpa_attention.py). ``unfused`` / ``local`` keep
        megatron-core's DotProductAttention, which holds the [b, heads, s, s] scores.
        Transformer Engine layers get the requested value itself (model/gpt.py passes it
        to megatron-core, which maps it to TE's NVTE_*_ATTN choice).
        """
        return "flash" if requested == "auto" else requested

    def masked_softmax_fusion_available(self) -> bool:
        """Whether megatron-core's fused masked softmax can run: a GPU and the compiled
        kernels it imports at its first call (apex's ``scaled_*softmax_cuda`` modules,
        absent from a plain pip install). Probed once per process."""
        if not self.is_cuda:
            return False
        return self.fused_softmax if self.fused_softmax is not None else _fused_softmax_imports()

    def peak_memory_gb(self) -> tuple[float, str]:
        """Peak device memory (CUDA) or peak resident set (CPU), in GB, with its meaning."""
        if self.is_cuda:
            return torch.cuda.max_memory_allocated() / 1e9, "max allocated"
        import resource
        import sys

        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss_kb * (1 if sys.platform == "darwin" else 1024) / 1e9, "peak RSS"

    def empty_cache(self) -> None:
        """Hand the CUDA caching allocator's unused blocks back to the driver
        (``--empty-unused-memory-level``); a CPU host has no such cache."""
        if self.is_cuda:
            torch.cuda.empty_cache()

    def rng_streams(self, *, host: bool = False, tracker=None) -> "RNGStreams":
        return RNGStreams(self, host=host, tracker=tracker)


class _DropNotice(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_host_notices() -> None:
    """Silence what megatron-core and torch announce about the host rather than the run.

    Without TE/apex (or, from 0.19, absl-py), megatron-core warns of each fallback it
    takes; a CUDA build of torch on a host with a CUDA toolkit but no driver logs "No CUDA
    runtime is found" when megatron-core imports ``torch.utils.cpp_extension``. Entry points call this first, so
    bad input stays one line on stderr. Nothing else from those loggers is dropped.
    """
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    warnings.filterwarnings("ignore", message="absl.logging is not installed")  # megatron-core 0.19
    logging.getLogger("torch.utils.cpp_extension").addFilter(_DropNotice("No CUDA runtime is found"))


FUSED_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                         "scaled_softmax_cuda")


@functools.cache
def _fused_softmax_imports() -> bool:
    """Import the kernels megatron-core's FusedScaleMaskSoftmax calls; one logged line if one is missing."""
    import importlib

    for name in FUSED_SOFTMAX_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            log.warning("notice: fused masked softmax off: %s does not import (megatron-core's torch softmax "
                        "is used)", name)
            return False
    return True


def detect_platform() -> Platform:
    """CUDA + NCCL when a GPU is visible (and not disabled), otherwise CPU + gloo."""
    force_cpu = os.environ.get("MEGATRON_WEIPIPE_FORCE_CPU", "0") == "1"
    if torch.cuda.is_available() and not force_cpu:
        return Platform("cuda", "nccl")
    return Platform("cpu", "gloo")


class RNGStreams:
    """Snapshot and restore of the random streams training draws from.

    Always torch's CPU generator and, on a CUDA host, the current device's; with
    ``host=True`` also Python's and numpy's (a checkpoint restores them); with a
    ``tracker`` (megatron-core's CUDA RNG tracker) its named streams, which dropout inside
    tensor-parallel regions draws from. A recomputed forward replays the snapshot taken
    before the original one, so it draws the same dropout masks. The state is a dict of
    tensors and plain values, loadable with ``torch.load(weights_only=True)``.
    """

    def __init__(self, platform: Platform, *, host: bool = False, tracker=None):
        self.platform, self.host, self.tracker = platform, host, tracker

    def get_state(self) -> dict:
        state = {
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if self.platform.is_cuda else None,
        }
        if self.host:
            import random

            import numpy as np

            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["random_rng_state"] = random.getstate()
            state["np_rng_state"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                                     float(cached))
        if self.tracker is not None:
            state["rng_tracker_states"] = dict(self.tracker.get_states())
        return state

    def set_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch_rng_state"])
        if self.platform.is_cuda and state.get("cuda_rng_state") is not None:
            torch.cuda.set_rng_state(state["cuda_rng_state"])
        if self.host and "random_rng_state" in state:
            import random

            import numpy as np

            random.setstate(_as_tuples(state["random_rng_state"]))
            kind, keys, pos, has_gauss, cached = state["np_rng_state"]
            keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
            np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
        if self.tracker is not None and "rng_tracker_states" in state:
            self.tracker.set_states(dict(state["rng_tracker_states"]))


def _as_tuples(x):
    """random.setstate wants the tuples it produced (a round trip may turn them into lists)."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how megatron passes torch.cuda.current_device().
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device arguments to the CPU and reports CPU tensors as CUDA types.

    Only arguments are rewritten; every op still runs the normal CPU kernel. Observers
    (``observing_device_requests``) see each call as the code made it, before the rewrite,
    with its result: what a GPU host would have put on the device.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _device_request_observers or getattr(_observed_call, "active", False):
            return self._redirected(func, args, kwargs)
        # The outermost call only: a stacked adapter (recomputation pushes one) sees it again,
        # already rewritten to the CPU.
        _observed_call.active = True
        try:
            result = self._redirected(func, args, kwargs)
        finally:
            _observed_call.active = False
        for observe in _device_request_observers:
            observe(func, args, kwargs, result)
        return result

    @staticmethod
    def _redirected(func, args, kwargs):
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


_device_request_observers: list = []
_observed_call = threading.local()


@contextlib.contextmanager
def observing_device_requests(fn):
    """Call ``fn(func, args, kwargs, result)`` for every torch call the CPU adapter sees,
    with the arguments as the code passed them (``device="cuda"`` still there).

    While observed, the Python backward of custom autograd functions runs under the
    adapter too (the engine starts backward with no torch-function mode), so what it
    creates is seen as well. Tests use this to check device discipline on a CPU host
    (tests/harness/devices.py)."""
    from torch.autograd.function import BackwardCFunction

    plain_apply = BackwardCFunction.apply

    def apply(self, *grads):
        # The backward call that got here is itself an observed call still running.
        outer, _observed_call.active = getattr(_observed_call, "active", False), False
        try:
            with _CudaToCpuMode():
                return plain_apply(self, *grads)
        finally:
            _observed_call.active = outer

    _device_request_observers.append(fn)
    BackwardCFunction.apply = apply
    try:
        yield
    finally:
        BackwardCFunction.apply = plain_apply
        _device_request_observers.remove(fn)


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

    def wait(self, *args, **kwargs):  # Event.wait(stream)
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


def adapter_mode():
    """What code run from inside a backward (a recompute) enters to see the CPU adapter
    again: its function mode where the adapter is installed (a backward runs without
    it, see ``install_cpu_adapter``), nothing elsewhere."""
    return _CudaToCpuMode() if _installed else contextlib.nullcontext()


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
    # A backward started through torch.autograd.backward runs with the mode below popped (a
    # mode is off while its own handler runs). megatron-core's full recomputation runs the
    # layers' forward inside CheckpointFunction.backward, so that backward enters it again.
    checkpoint = mcore_random.CheckpointFunction
    plain_backward = checkpoint.backward

    def recompute_backward(ctx, *grads):
        with _CudaToCpuMode():
            return plain_backward(ctx, *grads)

    checkpoint.backward = staticmethod(recompute_backward)

    # The tracker's "CUDA" stream is the CPU generator here, saved and restored around each
    # fork, so the fork's check that the CPU state is untouched is expected to fire.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )

    # A global mode: megatron-core's device="cuda" literals are spread across many modules.
    _CudaToCpuMode().__enter__()
    log.info("no GPU visible: megatron-core CUDA calls redirected to the CPU (gloo backend)")
