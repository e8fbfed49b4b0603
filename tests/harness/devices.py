"""Device discipline on a CPU host: which tensors a GPU run would hold on the host.

NCCL serves device tensors only; gloo takes anything, and on a CPU host every tensor is a
host tensor, so a collective handed a host tensor runs here and crashes on the first GPU
run ("No backend type associated with device type cpu"). ``DeviceDiscipline`` follows
where each tensor would live on a GPU host and records every collective or point-to-point
call on a would-be NCCL group that receives a host tensor.

How a tensor's place is known, from the calls as the code made them (the CPU adapter's
observers, platform.observing_device_requests, see ``device="cuda"`` before it becomes
the CPU):

- ``device=`` a CUDA device (megatron-core's ``torch.cuda.current_device()``, or the
  platform's ``collective_device()``, which answers ``cuda:0`` here while installed, as
  it would under NCCL), ``.cuda()`` and ``.to(cuda)``: on the device;
- ``.cpu()``, ``.to("cpu")``, ``pin_memory``, ``device="cpu"`` (the string), and factories
  given no device (``torch.tensor([...])``, ``torch.zeros(n)``): on the host;
- ``device=x.device`` (a ``torch.device`` object, "wherever x is") says nothing: a GPU host
  would pass its CUDA device there, so such a tensor's place is left unknown;
- any other op: on the device if an input is, on the host if every tensor input is;
- parameters and buffers of the models the run builds: on the device (``model.cuda()``
  on a GPU host; ``mark_module``); tensors read from a pickle (``torch.load``): on the
  host.

Tensors made inside C++ kernels of the backward are not seen: their place is unknown and
never reported. A move that returns its input here (``.cpu()`` of a CPU tensor) does not
re-mark that input, so a host copy made that way is missed.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

DEVICE, HOST = "device", "host"
UNKNOWN = "unknown"  # a request that names no place: the outputs keep none

# torch.distributed calls that take tensors (object collectives move their pickles
# to the device themselves and are left out).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base")
_MOVES_TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))
_WRAPPERS = ("megatron_weipipe/byte_counter.py", "megatron_weipipe/platform.py")  # frames that pass calls on
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Violation:
    call: str  # e.g. "all_reduce"
    site: str  # innermost frame outside torch and this harness
    tensor: str  # shape and dtype of the host tensor
    made: str  # the call that put it on the host, and where

    def __str__(self) -> str:
        return f"{self.call} of a host tensor {self.tensor} at {self.site} (made by {self.made})"


def _cuda_like(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _host_like(device) -> bool:
    """``"cpu"`` written as such. A ``torch.device("cpu")`` object is usually some tensor's
    ``.device`` ("wherever x is"), which a GPU host would answer with its CUDA device, so
    it says nothing about the place."""
    return isinstance(device, str) and device.startswith("cpu")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, dist.P2POp):
        yield x.tensor


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_THIS_DIR) or path.endswith(_WRAPPERS)):
            return f"{os.path.relpath(path) if 'site-packages' not in path else path.split('site-packages/')[1]}" \
                   f":{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


class DeviceDiscipline:
    """Install in a rank before ``initialize_distributed``; ``violations`` afterwards."""

    def __init__(self) -> None:
        self.places = WeakTensorKeyDictionary()
        self.origins = WeakTensorKeyDictionary()  # host tensor -> where it was made
        self.violations: list[Violation] = []
        self.checked_calls = 0  # collective calls on would-be NCCL groups, for the test's own sanity
        self._gloo_groups: set = set()
        self._undo: list = []
        self._observing = None

    # -- where tensors live ----------------------------------------------------------
    def place(self, t: torch.Tensor):
        return self.places.get(t)

    def is_host(self, t: torch.Tensor) -> bool:
        return self.places.get(t) == HOST

    def mark_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """What ``model.cuda()`` does on a GPU host: every parameter and buffer on the device."""
        for t in list(module.parameters()) + list(module.buffers()):
            self.places[t] = DEVICE
            self.places[t.data] = DEVICE
        return module

    def _observe(self, func, args, kwargs, result) -> None:
        outputs = list(_tensors(result))
        if not outputs:
            return
        inputs = [t for t in _tensors((args, kwargs))]
        place = self._requested(func, args, kwargs, inputs)
        if place is UNKNOWN or (place is None and isinstance(kwargs.get("device"), torch.device)):
            return  # device=x.device: wherever x is, which this host cannot say
        if place is None:
            places = [self.places.get(t) for t in inputs]
            if DEVICE in places:
                place = DEVICE
            elif places and all(p == HOST for p in places):
                place = HOST
            elif not inputs:
                place = HOST  # a factory given no device: the default device, the host
        if place is None:
            return
        moves = place != self._propagated(inputs)
        for t in outputs:
            # An in-place op or a no-op move returns its input: its place stays (a move of
            # an input to where it already is changes nothing).
            if any(t is i for i in inputs) and not moves:
                continue
            if any(t is i for i in inputs) and (func in _MOVES_TO_HOST or func is torch.Tensor.to):
                continue  # .cpu() of a CPU tensor returns it: do not re-mark the device tensor
            self.places[t] = place
            if place == HOST:
                self.origins[t] = f"{getattr(func, '__name__', func)} at {_site()}"

    def _propagated(self, inputs):
        places = [self.places.get(t) for t in inputs]
        return DEVICE if DEVICE in places else (HOST if places and all(p == HOST for p in places) else None)

    @staticmethod
    def _requested(func, args, kwargs, inputs):
        """The place a call asks for explicitly, or None."""
        if func is torch.Tensor.cuda:
            return DEVICE
        if func in _MOVES_TO_HOST or kwargs.get("pin_memory"):
            return HOST
        target = kwargs.get("device")
        if func is torch.Tensor.to and target is None and len(args) > 1:
            target = args[1]
            if isinstance(target, torch.Tensor):
                return None  # .to(other): follows other (an input)
        if target is None:
            return None
        if isinstance(target, torch.device) and target.type == "cpu":
            return UNKNOWN  # x.to(y.device): wherever y is
        if _cuda_like(target):
            return DEVICE
        if _host_like(target):
            return HOST
        return None

    # -- collectives -----------------------------------------------------------------
    def _nccl_group(self, group) -> bool:
        return group not in self._gloo_groups

    def _check(self, name: str, fn):
        discipline = self

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                group = args[0][0].group if args and args[0] else None
            if discipline._nccl_group(group):
                discipline.checked_calls += 1
                for t in _tensors((args, kwargs)):
                    if discipline.places.get(t) == HOST:
                        discipline.violations.append(
                            Violation(name, _site(), f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}",
                                      discipline.origins.get(t, "?")))
            return fn(*args, **kwargs)

        return inner

    def _unpickled_on_host(self, fn):
        """Tensors read from a pickle (``torch.load``, checkpoint common state): made in C++,
        otherwise unseen; a GPU host reads them to the host unless mapped to CUDA, which
        this host cannot tell, so they count as host (e.g. Adam's step counters)."""
        discipline = self

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            t = fn(*args, **kwargs)
            discipline.places[t] = HOST
            return t

        return inner

    def _record_gloo(self, fn):
        discipline = self

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            group = fn(*args, **kwargs)
            if kwargs.get("backend") in ("gloo", dist.Backend.GLOO):
                discipline._gloo_groups.add(group)
            return group

        return inner

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self) -> "DeviceDiscipline":
        from megatron_weipipe import platform

        platform.install_cpu_adapter()
        # The platform's rule for collectives answers as under NCCL (the CUDA device, which the
        # adapter turns into the CPU), except for groups made for gloo.
        self._patch(platform.Platform, "collective_device",
                    lambda p, group=None: torch.device("cuda", 0) if self._nccl_group(group) else torch.device("cpu"))
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._check(name, getattr(dist, name)))
        self._patch(dist, "new_group", self._record_gloo(dist.new_group))
        self._patch(torch._utils, "_rebuild_tensor_v2", self._unpickled_on_host(torch._utils._rebuild_tensor_v2))
        try:  # megatron-core binds its distributed optimizer's collectives at import
            from megatron.core.distributed import param_and_grad_buffer as pgb

            for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
                if hasattr(pgb, name):
                    self._patch(pgb, name, self._check(name, getattr(pgb, name)))
        except ImportError:
            pass
        self._observing = platform.observing_device_requests(self._observe)
        self._observing.__enter__()
        return self

    def uninstall(self) -> None:
        if self._observing is not None:
            self._observing.__exit__(None, None, None)
            self._observing = None
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()

