"""Block attention kernels that return the log-sum-exp, and which one runs where.

The interface (shapes, the final-lse backward) and the math reference are in
``fpdt.kernel_base``; torch's CUDA ops in ``fpdt.cuda_kernels``. Backends:

  math            plain matmul + logsumexp; any dtype (float64 for exactness tests), any device.
  cpu_flash       aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); float32/bf16/fp16.
  cudnn           aten._scaled_dot_product_cudnn_attention (+ _backward); CUDA fp16/bf16.
  cuda_flash      aten._scaled_dot_product_flash_attention (+ _backward); CUDA fp16/bf16,
                  head_dim a multiple of 8 and <= 256.
  cuda_efficient  aten._scaled_dot_product_efficient_attention (+ _backward); CUDA fp32/fp16/bf16.

"auto": on CPU cpu_flash, math for float64. On CUDA the candidates of ``cuda_kernels``
(dtype, head_dim) are tried in that order, each probed (its schemas bind in this torch,
grouped heads probed) and self-checked against the math kernel on small shapes at first
use, per (device, dtype, head_dim); the first that passes is kept for the process, with
one logged line naming it and why the earlier ones were passed over. When none passes,
math is left, and refused (``check_math_block``, a ConfigError naming
--fpdt-chunk-size) where one block's scores would exceed MATH_SCORES_BUDGET: on a long
chunk it could only run out of memory.
"""

from __future__ import annotations

import logging

import torch

from megatron_weipipe.errors import ConfigError
from megatron_weipipe.fpdt.config import AUTO_KERNEL, BLOCK_KERNELS
from megatron_weipipe.fpdt.cuda_kernels import CUDA_KERNELS, CudaEfficientKernel, CudaFlashKernel, CudnnKernel
from megatron_weipipe.fpdt.kernel_base import (  # noqa: F401 - the kernels' public names live here
    SELF_CHECK_TOL,
    GroupedKernel,
    MathKernel,
    acc_dtype,
    accumulate_matmul,
    merge,
    scores_bytes,
    self_check,
)

log = logging.getLogger(__name__)
_logged: set = set()

HALF = (torch.float16, torch.bfloat16)
# The most bytes of one block's scores (b x heads x sq x sk, fp32) the math kernel may
# hold on CUDA; its backward holds about three such tensors at once.
MATH_SCORES_BUDGET = 2 * 2**30
# Self-check shapes: small (milliseconds), grouped heads, a full and a causal block.
CHECK_SHAPE = dict(b=1, hq=4, hkv=2, s=128)


class CpuFlashKernel(GroupedKernel):
    """torch's CPU flash-attention op (returns logsumexp). Recent torch handles GQA in the
    op itself (probed once); older versions get GroupedKernel's fold / expand."""

    name = "cpu_flash"
    _native_gqa_probe: bool | None = None

    @classmethod
    def native_gqa(cls) -> bool:
        if cls._native_gqa_probe is None:
            q, kv = torch.zeros(1, 2, 2, 8), torch.zeros(1, 1, 2, 8)
            try:
                o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, True)
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(o, q, kv, kv, o, lse, 0.0, True)
                cls._native_gqa_probe = tuple(grads[1].shape) == tuple(kv.shape)
            except RuntimeError:
                cls._native_gqa_probe = False
        return cls._native_gqa_probe

    def prepare(self, device, dtype, head_dim) -> None:
        self.native_gqa()

    def native_gqa_for(self, q) -> bool:
        return self.native_gqa()

    def _forward(self, q, k, v, causal: bool, scale: float):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
        )
        return out, lse.to(acc_dtype(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            lse.float().contiguous(), 0.0, causal, scale=scale,
        )


def _kernel_classes() -> dict:
    """The class of every kernel fpdt/config.py names, in its order; an error at import if
    a name has no class or a class no name."""
    classes = {k.name: k for k in (MathKernel, CpuFlashKernel, *CUDA_KERNELS.values())}
    if set(classes) != set(BLOCK_KERNELS):
        raise ImportError(f"FPDT kernel classes {sorted(classes)} differ from fpdt/config.py's {sorted(BLOCK_KERNELS)}")
    return {name: classes[name] for name in BLOCK_KERNELS}


KERNEL_CLASSES = _kernel_classes()


def cuda_kernels(dtype: torch.dtype, head_dim: int = 64, capability: tuple = (9, 0)) -> tuple[str, ...]:
    """The CUDA kernels that can serve (dtype, head_dim), in the order ``auto`` tries them
    (the acceptance checks self-check each). fp16/bf16: cuDNN first from Hopper (sm90) on,
    where it is the faster one, flash first before it, memory-efficient last; fp32: only
    memory-efficient (flash and cuDNN are half precision only); float64: none."""
    if dtype in HALF:
        fused = [n for n in ("cudnn", "cuda_flash") if head_dim % 8 == 0 and head_dim <= 256]
        if tuple(capability) < (9, 0):
            fused.reverse()
        return (*fused, "cuda_efficient")
    if dtype == torch.float32:
        return ("cuda_efficient",)
    return ()


def _allowed(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why kernel ``name`` cannot take (device, dtype) at all, or None."""
    if name == "cpu_flash" and (device.type != "cpu" or dtype == torch.float64):
        return f"kernel 'cpu_flash' needs a CPU float32/bf16/fp16 tensor, got {device.type} {dtype}"
    if name in ("cuda_flash", "cudnn") and (device.type != "cuda" or dtype not in HALF):
        return f"kernel {name!r} needs a CUDA fp16/bf16 tensor, got {device.type} {dtype}"
    if name == "cuda_efficient" and (device.type != "cuda" or dtype not in (*HALF, torch.float32)):
        return f"kernel 'cuda_efficient' needs a CUDA fp32/fp16/bf16 tensor, got {device.type} {dtype}"
    return None


class KernelProbe:
    """The device facts ``auto`` asks on CUDA (a test passes a fake one)."""

    def capability(self, device: torch.device) -> tuple:
        try:
            return tuple(torch.cuda.get_device_capability(device))
        except (AssertionError, RuntimeError):  # torch without CUDA
            return (0, 0)

    def prepare(self, kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        """The kernel's one-off probes (schemas bind, grouped heads), before its first call."""
        kernel.prepare(device, dtype, head_dim)

    def check(self, name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
        """Probe kernel ``name`` and return its self-check error (raises if it cannot run)."""
        kern = KERNEL_CLASSES[name]()
        self.prepare(kern, device, dtype, head_dim)
        return self_check(kern, device, dtype, d=head_dim, **CHECK_SHAPE)


DEFAULT_PROBE = KernelProbe()
_CHOSEN: dict = {}


def choose_cuda_kernel(device, dtype: torch.dtype, head_dim: int, probe: KernelProbe) -> tuple[str, list[str]]:
    """The first of ``cuda_kernels`` that passes its probe and self-check, else "math";
    and why each one before it was passed over."""
    passed_over = []
    for name in cuda_kernels(dtype, head_dim, probe.capability(device)):
        try:
            err = probe.check(name, device, dtype, head_dim)
        except Exception as e:  # noqa: BLE001 - any failure to run rules the kernel out
            passed_over.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
            continue
        if err <= SELF_CHECK_TOL[dtype]:
            return name, passed_over
        passed_over.append(f"{name}: self-check error {err:.2g} > {SELF_CHECK_TOL[dtype]:g}")
    return "math", passed_over


def check_math_block(device: torch.device, dtype: torch.dtype, head_dim: int, block, why: str = "") -> None:
    """Refuse the math kernel on CUDA for a block ``(b, heads, sq, sk)`` whose scores
    exceed MATH_SCORES_BUDGET (it would run out of memory), in one line naming the flag."""
    if device.type != "cuda" or block is None or scores_bytes(block, dtype) <= MATH_SCORES_BUDGET:
        return
    b, heads, sq, sk = block
    per_row = scores_bytes((b, heads, 1, 1), dtype)
    fits = int((MATH_SCORES_BUDGET / per_row) ** 0.5)
    raise ConfigError(
        f"FPDT attention on {device.type} {dtype} (head_dim {head_dim}) has only the math kernel"
        f"{' (' + why + ')' if why else ''}, and one block's scores would take "
        f"{scores_bytes(block, dtype) / 2**30:.1f} GiB (b {b} x {heads} heads x {sq} x {sk}) over its "
        f"{MATH_SCORES_BUDGET / 2**30:g} GiB budget: lower --fpdt-chunk-size to at most {fits}"
        f"{', or train in bf16' if dtype not in HALF else ''}"
    )


def _resolve_auto(device: torch.device, dtype: torch.dtype, head_dim: int, probe: KernelProbe | None):
    if dtype == torch.float64:
        return "math", []
    if device.type != "cuda":
        return ("cpu_flash", []) if device.type == "cpu" else ("math", [])
    if probe is not None:  # an explicit probe (a test): decide afresh
        return choose_cuda_kernel(device, dtype, head_dim, probe)
    key = (str(device), dtype, head_dim)
    if key not in _CHOSEN:
        _CHOSEN[key] = choose_cuda_kernel(device, dtype, head_dim, DEFAULT_PROBE)
    return _CHOSEN[key]


def select_kernel(choice: str, device, dtype: torch.dtype, head_dim: int, block=None, *,
                  probe: KernelProbe | None = None):
    """Kernel object for a device/dtype; ``choice`` is FPDTConfig.kernel. ``block`` =
    (b, heads, sq, sk), the largest block it will be given: the math kernel is refused on
    CUDA where that block's scores exceed MATH_SCORES_BUDGET. Probes run here, before the
    first forward, so none runs inside a forward or backward."""
    device = torch.device(device)
    if choice == AUTO_KERNEL:
        name, passed_over = _resolve_auto(device, dtype, head_dim, probe)
    else:
        name, passed_over = choice, []
        if name not in KERNEL_CLASSES:
            raise ValueError(f"kernel {name!r} is not one of {tuple(KERNEL_CLASSES)}")
        problem = _allowed(name, device, dtype)
        if problem:
            raise ValueError(problem)
    why = "; ".join(passed_over) if choice == AUTO_KERNEL else "kernel='math' was asked for"
    if name == "math":
        check_math_block(device, dtype, head_dim, block, why)
    kernel = KERNEL_CLASSES[name]()
    (probe or DEFAULT_PROBE).prepare(kernel, device, dtype, head_dim)
    key = (name, str(device), dtype, head_dim)
    if key not in _logged:
        _logged.add(key)
        (log.warning if passed_over else log.info)(
            "FPDT block attention kernel: %s (%s, %s, head_dim %d)%s", name, device, dtype, head_dim,
            f"; passed over {why}" if passed_over else "")
    return kernel


__all__ = [
    "CpuFlashKernel", "CudaEfficientKernel", "CudaFlashKernel", "CudnnKernel", "GroupedKernel", "KERNEL_CLASSES",
    "KernelProbe", "MathKernel", "acc_dtype", "accumulate_matmul", "check_math_block", "choose_cuda_kernel",
    "cuda_kernels", "merge", "scores_bytes", "select_kernel", "self_check",
]
