"""Count the host syncs a piece of training code would make on a GPU.

On a GPU, ``.item()``, ``bool(tensor)``, ``.tolist()``, ``.cpu()`` and their kin wait until
the device has drained every queued kernel. Inside forward-backward that stalls the host,
so the next operations (WeiPipe's sends and receives of the next tick, the next chunk's
prefetch) are posted late. On a CPU host they cost nothing, so nothing shows them; this
module counts them.

``SyncCounter`` wraps the tensor methods that read a value back to Python (patched on
``torch.Tensor`` itself, so calls from Python code in an autograd backward count too) and
records each call's site (the innermost frame outside torch). ``regions`` attribute a
call to the innermost open region, e.g. "forward_backward" around a schedule's
``forward_backward`` or "iteration" around everything else: the syncs of a region are
then a dict {site: calls}. Tensor-valued C++ internals (a NaN check inside a torch
kernel) do not count: only Python-level calls, which are the ones the project can move.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import Counter, defaultdict

import torch

# Tensor methods that hand a value to the host, and so wait for the device.
READBACKS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")
# torch functions that return a Python value computed on the device.
VALUE_FUNCTIONS = ("equal", "allclose", "is_nonzero")

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
# The CPU adapter passes calls on (a .to("cuda") becomes .to("cpu") there): not a site.
_ADAPTER = os.path.join("megatron_weipipe", "platform.py")


def _optimizer_step_count() -> bool:
    """torch's optimizers read their ``step`` counters with ``_get_value``: host tensors
    unless the optimizer is capturable or fused (torch keeps them there on purpose)."""
    caller = sys._getframe(2).f_code
    return caller.co_name == "_get_value" and caller.co_filename.startswith(os.path.join(_TORCH_DIR, "optim"))


def _site() -> str:
    """'file:line in function' of the innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_TORCH_DIR) or path == _THIS_FILE or "contextlib" in path or path.endswith(_ADAPTER)):
            rel = path.split("site-packages" + os.sep, 1)[-1]
            for root in (os.getcwd() + os.sep, os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep):
                rel = rel.replace(root, "")
            return f"{rel}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


class SyncCounter:
    """Counts host syncs by region and call site while installed.

    ``is_host(tensor)``, if given, tells tensors a GPU host would hold in host memory
    (harness/devices.py): reading those back waits for nothing, so they do not count
    (e.g. Adam's step counters, kept on the host by torch).
    """

    def __init__(self, is_host=None) -> None:
        self.is_host = is_host or (lambda t: False)
        self.calls: dict[str, Counter] = defaultdict(Counter)
        self._stack = threading.local()
        self._saved: dict = {}

    # -- regions -------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str):
        stack = self._regions()
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    def _regions(self) -> list:
        if not hasattr(self._stack, "names"):
            self._stack.names = []
        return self._stack.names

    def record(self, what: str) -> None:
        stack = self._regions()
        if stack:
            self.calls[stack[-1]][f"{what} at {_site()}"] += 1

    @contextlib.contextmanager
    def _outermost(self, what: str, counts: bool = True):
        """Count a call once: a read-back that calls another (``float(t)`` calls ``item``,
        a torch-function mode calls the method again) is one sync, or none if the
        outermost one does not count."""
        busy = getattr(self._stack, "busy", False)
        if not busy:
            if counts:
                self.record(what)
            self._stack.busy = True
        try:
            yield
        finally:
            if not busy:
                self._stack.busy = False

    def in_region(self, name: str) -> dict[str, int]:
        return dict(self.calls.get(name, {}))

    # -- installation --------------------------------------------------------------
    def install(self) -> "SyncCounter":
        for name in READBACKS:
            original = getattr(torch.Tensor, name)
            self._saved[("Tensor", name)] = original
            setattr(torch.Tensor, name, self._wrap(original, f"Tensor.{name.strip('_')}"))
        self._saved[("Tensor", "to")] = torch.Tensor.to
        torch.Tensor.to = self._wrap_to(torch.Tensor.to)
        for name in VALUE_FUNCTIONS:
            original = getattr(torch, name)
            self._saved[("torch", name)] = original
            setattr(torch, name, self._wrap(original, f"torch.{name}"))
        return self

    def uninstall(self) -> None:
        for (owner, name), original in self._saved.items():
            setattr(torch.Tensor if owner == "Tensor" else torch, name, original)
        self._saved.clear()

    def __enter__(self) -> "SyncCounter":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, fn, what: str):
        counter = self

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            waits = not ((tensors and all(counter.is_host(t) for t in tensors)) or _optimizer_step_count())
            with counter._outermost(what, waits):
                return fn(*args, **kwargs)

        return inner

    def _wrap_to(self, fn):
        """``.to("cpu")`` without non_blocking waits for the device; other moves do not."""
        counter = self

        @functools.wraps(fn)
        def inner(self_, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            rewritten = sys._getframe(1).f_code.co_filename.endswith(_ADAPTER)  # was .to("cuda")
            waits = not (rewritten or counter.is_host(self_)) and _names_cpu(target) and not kwargs.get("non_blocking")
            with counter._outermost("Tensor.to(cpu)", waits):
                return fn(self_, *args, **kwargs)

        return inner


def _names_cpu(target) -> bool:
    if isinstance(target, torch.device):
        return target.type == "cpu"
    return isinstance(target, str) and target.startswith("cpu")

