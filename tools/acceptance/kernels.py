"""FPDT kernel checks of the acceptance script, one code path for CPU and CUDA.

- ``kernel_check``: one block-attention kernel (cpu_flash / cuda_flash) against the math
  kernel, forward and backward, over two key blocks merged by log-sum-exp (the kernels'
  own ``self_check``).
- ``chunked_check``: FPDT's chunked online-softmax attention layer (QKV projection,
  chunks, output projection) against an independent unchunked float64 reference on the
  CPU (torch's scaled_dot_product_attention over the whole sequence), forward and
  backward (dx, dW_qkv, dW_proj); errors are relative to the reference's largest value.
- ``offload_check`` (CUDA): FPDT with offload on a side stream is bitwise equal to FPDT
  without, and the profiler's trace shows the copies overlapping compute kernels.
- ``delayed_copy_check`` (CUDA): the same with every copy delayed on its side stream
  (tools/acceptance/copy_delay.py): still bitwise equal.

Each returns (ok, figure, seconds).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megatron_weipipe.fpdt import FPDTConfig, HostBufferPool, fpdt_attention
from megatron_weipipe.fpdt.config import AttentionSpec
from megatron_weipipe.fpdt.kernels import select_kernel, self_check

# Largest |error| / max|reference| accepted (measured here: see docs/results/gpu-acceptance.md).
KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # absolute, unit-variance inputs
CHUNKED_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# Smallest share of the host<->device copy time that must run while a compute kernel runs.
MIN_OVERLAP = 0.25


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_check(device: str, dtype: torch.dtype, s: int = 256, d: int = 64, kernel: str = "auto"):
    """Block kernel ``kernel`` (``auto``: the one FPDT picks for (device, dtype)) vs the math
    kernel; fwd (out, lse) + bwd."""
    device = torch.device(device)
    t0 = time.perf_counter()
    kern = select_kernel(kernel, device, dtype, d)
    err = self_check(kern, device, dtype, hq=4, hkv=2, s=s, d=d)
    tol = KERNEL_TOL[dtype]
    figure = f"{kern.name}: max abs err {err:.2g} (tol {tol:g}; b1 h4/2 s{s}+{s} d{d})"
    return err <= tol, figure, time.perf_counter() - t0


def _layer(S: int, hidden: int, heads: int, groups: int, seed: int = 0):
    spec = AttentionSpec(hidden, heads, hidden // heads, groups, rotary=None)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, 1, hidden, generator=g, dtype=torch.float64)
    wq = torch.randn(spec.qkv_size, hidden, generator=g, dtype=torch.float64) * hidden**-0.5
    wp = torch.randn(hidden, spec.proj_input_size, generator=g, dtype=torch.float64) * spec.proj_input_size**-0.5
    dy = torch.randn(S, 1, hidden, generator=g, dtype=torch.float64)
    return spec, x, wq, wp, dy


def reference_attention(x, wq, wp, spec: AttentionSpec):
    """Causal self-attention of the whole sequence, Megatron's fused-QKV layout, no rotary."""
    S, b, _ = x.shape
    ng, g, d = spec.groups, spec.heads_per_group, spec.head_dim
    q, k, v = torch.split(F.linear(x, wq).view(S, b, ng, (g + 2) * d), [g * d, d, d], dim=3)
    q = q.reshape(S, b, ng * g, d)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=True)
    return F.linear(o.permute(2, 0, 1, 3).reshape(S, b, -1), wp)


def _grads(fn, x, wq, wp, dy):
    x, wq, wp = (t.detach().clone().requires_grad_(True) for t in (x, wq, wp))
    out = fn(x, wq, wp)
    out.backward(dy.to(out.dtype))
    return [out.detach(), x.grad, wq.grad, wp.grad]


def chunked_check(device: str, dtype: torch.dtype, S: int = 512, chunks: int = 4, hidden: int = 128,
                  heads: int = 4, groups: int = 2, offload: bool = True):
    """FPDT's chunked attention (``chunks`` chunks, offload on) vs the float64 reference."""
    device = torch.device(device)
    t0 = time.perf_counter()
    spec, x, wq, wp, dy = _layer(S, hidden, heads, groups)
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, spec), x, wq, wp, dy)
    cfg = FPDTConfig(chunk_size=S // chunks, offload=offload)
    pool = HostBufferPool(pin_memory=device.type == "cuda")
    cast = [t.to(device=device, dtype=dtype) for t in (x, wq, wp, dy)]
    got = _grads(lambda a, b, c: fpdt_attention(a, b, None, c, None, spec, cfg, pool=pool), *cast)
    _sync(device)
    names = ("out", "dx", "dW_qkv", "dW_proj")
    errs = {n: ((g.double().cpu() - r).abs().max() / r.abs().max()).item() for n, g, r in zip(names, got, ref)}
    worst = max(errs, key=errs.get)
    tol = CHUNKED_TOL[dtype]
    kern = select_kernel("auto", device, dtype, spec.head_dim).name
    figure = (f"{kern}, {chunks} chunks{' offload' if offload else ''}: max rel err {errs[worst]:.2g} ({worst}; "
              f"tol {tol:g}; S{S} h{hidden} heads {heads}/{groups})")
    return errs[worst] <= tol, figure, time.perf_counter() - t0


def _overlap_share(events) -> tuple[float, float]:
    """(share of host<->device memcpy time during which a kernel ran on another stream, copy ms).

    ``events`` are the profiler's FunctionEvents; device activities carry their CUDA stream
    in ``device_resource_id`` and their interval in ``time_range`` (microseconds)."""
    copies, kernels = [], []
    for e in events:
        if "cuda" not in str(getattr(e, "device_type", "")).lower():
            continue
        name, stream = e.name.lower(), getattr(e, "device_resource_id", None)
        interval = (e.time_range.start, e.time_range.end, stream)
        if "memcpy" in name and ("htod" in name or "dtoh" in name):
            copies.append(interval)
        elif "memcpy" not in name and "memset" not in name:
            kernels.append(interval)
    total = sum(b - a for a, b, _ in copies)
    overlapped = 0.0
    for a, b, s in copies:
        covered = sorted((max(a, ka), min(b, kb)) for ka, kb, ks in kernels if ks != s and ka < b and kb > a)
        end = a
        for lo, hi in covered:
            lo = max(lo, end)
            if hi > lo:
                overlapped += hi - lo
                end = hi
    return (overlapped / total if total else 0.0), total / 1e3


def offload_check(device: str, dtype: torch.dtype, S: int = 16384, chunks: int = 8, hidden: int = 1024,
                  heads: int = 8, groups: int = 8):
    """Offload vs none: bitwise equal outputs and grads; copies overlap compute (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    t0 = time.perf_counter()
    spec, x, wq, wp, dy = _layer(S, hidden, heads, groups)
    cast = [t.to(device=device, dtype=dtype) for t in (x, wq, wp, dy)]
    pool = HostBufferPool(pin_memory=device.type == "cuda")

    def run(offload):
        cfg = FPDTConfig(chunk_size=S // chunks, offload=offload)
        return _grads(lambda a, b, c: fpdt_attention(a, b, None, c, None, spec, cfg, pool=pool), *cast)

    plain, off = run(False), run(True)  # the second also warms the pool
    _sync(device)
    exact = all(torch.equal(a, b) for a, b in zip(plain, off))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(True)
        _sync(device)
    share, copy_ms = _overlap_share(prof.events())
    figure = (f"offload == no offload: {'bitwise' if exact else 'DIFFERENT'}; copies {copy_ms:.1f} ms, "
              f"{share:.0%} under compute (min {MIN_OVERLAP:.0%}; S{S} h{hidden} {chunks} chunks)")
    return exact and share >= MIN_OVERLAP, figure, time.perf_counter() - t0


def delayed_copy_check(device: str, dtype: torch.dtype, S: int = 16384, chunks: int = 8, hidden: int = 1024,
                       heads: int = 8, groups: int = 8):
    """Offload with each copy delayed ~1 ms on its side stream vs no offload: bitwise equal
    (deterministic algorithms; the no-offload run twice is the control)."""
    from tools.acceptance.copy_delay import delay
    from megatron_weipipe.fpdt.copy_streams import for_device

    device = torch.device(device)
    t0 = time.perf_counter()
    spec, x, wq, wp, dy = _layer(S, hidden, heads, groups)
    cast = [t.to(device=device, dtype=dtype) for t in (x, wq, wp, dy)]
    copies = [0]
    pools = {False: HostBufferPool(pin_memory=device.type == "cuda"),
             True: HostBufferPool(pin_memory=device.type == "cuda", copy_streams=delay(for_device(device), copies))}

    def run(offload, delayed=False):
        cfg = FPDTConfig(chunk_size=S // chunks, offload=offload)
        pool = pools[delayed]
        return _grads(lambda a, b, c: fpdt_attention(a, b, None, c, None, spec, cfg, pool=pool), *cast)

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        plain, again, late = run(False), run(False), run(True, delayed=True)
        _sync(device)
    finally:
        torch.use_deterministic_algorithms(previous)
    decidable = all(torch.equal(a, b) for a, b in zip(plain, again))
    exact = all(torch.equal(a, b) for a, b in zip(plain, late))
    how = "delayed ~1 ms" if device.type == "cuda" else "counted (no side stream here)"
    figure = (f"{copies[0]} copies {how}: {'bitwise' if exact else 'DIFFERENT'} to no offload; no offload "
              f"twice: {'bitwise' if decidable else 'DIFFERENT (undecided)'} (S{S} h{hidden} {chunks} chunks)")
    return exact and decidable and copies[0] > 0, figure, time.perf_counter() - t0


def rng_replay_check(device: str):
    """RNGStreams on CUDA: restoring a snapshot replays the dropout masks of the default CUDA
    generator and of megatron-core's tracker stream (a separate CUDA RNG state)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_weipipe.platform import detect_platform

    t0 = time.perf_counter()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 4321)
    torch.cuda.manual_seed(1234)
    streams = detect_platform().rng_streams(tracker=tracker)
    x = torch.ones(4096, device=device)

    def draw():
        a = F.dropout(x, 0.5)
        with tracker.fork():
            b = F.dropout(x, 0.5)
        return a, b, F.dropout(x, 0.5)

    state = streams.get_state()
    first = draw()
    streams.set_state(state)
    again = draw()
    same = all(torch.equal(p, q) for p, q in zip(first, again))
    separate = not torch.equal(first[0], first[1])
    figure = f"replayed masks {'equal' if same else 'DIFFER'}; tracker stream {'separate' if separate else 'SHARED'}"
    return same and separate, figure, time.perf_counter() - t0
