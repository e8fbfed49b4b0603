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

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def pin_memory(self) -> bool:
        """Page-locked host buffers speed up copies to a GPU; on a CPU host they are pointless."""
        return self.is_cuda

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")

    def device_count(self) -> int:
        """CUDA devices visible to this process (0 on a CPU host)."""
        return torch.cuda.device_count() if self.is_cuda else 0

    def transformer_engine_available(self) -> bool:
        import importlib.util

        if self.transformer_engine is not None:
            return self.is_cuda and self.transformer_engine
        return self.is_cuda and importlib.util.find_spec("transformer_engine") is not None

    def attention_backend(self, requested: str = "auto") -> str:
        """The core attention a Megatron-LM ``--attention-backend`` value selects here.

        Without a GPU, ``auto`` is ``flash``: torch's fused scaled-dot-product kernel
        (memory linear in the sequence), so long sequences fit; ``unfused`` / ``local`` keep
        megatron-core's unfused DotProductAttention. On a CUDA host the value is returned
        as given and the layer spec decides as before (Transformer Engine when installed).
        """
        if self.is_cuda:
            return requested
        return "flash" if requested == "auto" else requested

    def peak_memory_gb(self) -> tuple[float, str]:
        """Peak device memory (CUDA) or peak resident set (CPU), in GB, with its meaning."""
        if self.is_cuda:
            return torch.cuda.max_memory_allocated() / 1e9, "max allocated"
        import resource
        import sys

        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss_kb * (1 if sys.platform == "darwin" else 1024) / 1e9, "peak RSS"

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
