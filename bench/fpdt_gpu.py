"""FPDT on one CUDA device: kernel checks and speeds, overhead over plain attention,
attention TFLOP/s, and the longest sequence a Llama-3-8B-shaped layer fits with and
without offload.

One prepared script for a lent GPU (see MEASURING.md): warm-up, CUDA events, medians of
alternating rounds, random inputs, tables printed at the end and written to $OUT (if set)
as fpdt_gpu.md and fpdt_gpu.json. Single device, so P = 1: "plain" is ulysses_attention
without a group (whole sequence, the kernel ``auto`` picks), FPDT is the chunked pipeline.
The kernel section self-checks every CUDA block kernel (``kernels.cuda_kernels``) for
the run's dtype and fp32 against the math kernel, and times one block of each.

  python -m bench.fpdt_gpu                      # H100/H200-sized defaults, a few minutes
  python -m bench.fpdt_gpu --device cpu --tiny  # the same code on CPU with tiny shapes

Sections can be skipped (--skip check kernels overhead longest) to fit a time budget; the
longest-sequence search is bounded by --budget-gib, --max-seq and --bisect-steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from bench.fpdt_util import (
    LLAMA3_8B,
    Layer,
    LayerShape,
    attention_flops,
    make_params,
    peak_rss_bytes,
    rss_bytes,
)
from megatron_weipipe.fpdt import FPDTConfig, HostBufferPool, fpdt_attention, ulysses_attention
from megatron_weipipe.fpdt.kernels import cuda_kernels, select_kernel, self_check

GiB = 2**30


class Clock:
    """CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


class Memory:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def reset(self) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return rss_bytes()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else peak_rss_bytes()


def _cuda_candidates(device, head_dim, dtype):
    """(name, dtype) of every CUDA block kernel for the run's dtype and for fp32."""
    cap = torch.cuda.get_device_capability(device)
    return [(n, dt) for dt in dict.fromkeys((dtype, torch.float32)) for n in cuda_kernels(dt, head_dim, cap)]


def kernel_check(device, dtype, head_dim):
    """auto's pick against the math kernel; on CUDA every candidate kernel too, each
    for the run's dtype and fp32 (an error string where a kernel cannot run)."""
    kern = select_kernel("auto", device, dtype, head_dim)
    err = self_check(kern, device, dtype, s=256, d=head_dim)
    each = {}
    for name, dt in _cuda_candidates(device, head_dim, dtype) if device.type == "cuda" else []:
        try:
            each[f"{name} {dt}"] = self_check(select_kernel(name, device, dt, head_dim), device, dt, s=256, d=head_dim)
        except Exception as e:  # noqa: BLE001 - reported, not fatal: auto passes over such kernels
            each[f"{name} {dt}"] = f"{type(e).__name__}: {e}"[:200]
    return {"kernel": kern.name, "max_abs_err_vs_math": err, "each": each}


def kernel_speed(device, dtype, shape: LayerShape, seq, rounds):
    """One FPDT block per CUDA kernel, the shape of one chunk pair of the layer at chunk
    ``seq`` (P = 1): forward + backward of a full and of a causal block, median ms, and
    model TFLOP/s (forward 4*b*h*sq*sk*d, halved when causal; backward 2x forward)."""
    clock = Clock(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    b, h, hkv, d = shape.batch, shape.heads, shape.groups, shape.head_dim
    q, do, k, v = rnd(b, h, seq, d), rnd(b, h, seq, d), rnd(b, hkv, seq, d), rnd(b, hkv, seq, d)
    rows = []
    for name, dt in _cuda_candidates(device, d, dtype):
        if dt != dtype:
            continue
        kern = select_kernel(name, device, dtype, d)
        for causal in (False, True):
            def step():
                o, lse = kern.forward(q, k, v, causal, d**-0.5)
                kern.backward(do, q, k, v, o, lse, causal, d**-0.5)

            try:
                step()
                ts = sorted(clock.time(step) for _ in range(rounds))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(kernel=name, causal=causal, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            t = ts[len(ts) // 2]
            flops = 3 * 4.0 * b * h * seq * seq * d * (0.5 if causal else 1.0)
            gqa = "native" if hkv == h or kern.native_gqa_for(q) else "folded, causal expanded"
            rows.append(dict(kernel=name, causal=causal, ms=t * 1e3, tflops=flops / t / 1e12, gqa=gqa))
    return rows


def overhead(device, dtype, shape: LayerShape, seq, chunks, rounds, offload):
    """Attention layer fwd+bwd: plain vs FPDT-u, alternating, medians; TFLOP/s of the core."""
    spec = shape.spec()
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(seq, shape.batch, shape.hidden).requires_grad_(True)
    dy = rnd(seq, shape.batch, shape.hidden)
    wq = rnd(spec.qkv_size, shape.hidden, scale=shape.hidden**-0.5).requires_grad_(True)
    wp = rnd(shape.hidden, spec.proj_input_size, scale=spec.proj_input_size**-0.5).requires_grad_(True)
    pool = HostBufferPool(pin_memory=device.type == "cuda")
    clock = Clock(device)

    def plain():
        ulysses_attention(x, wq, None, wp, None, spec).backward(dy)

    def fpdt(u, off):
        cfg = FPDTConfig(chunk_size=seq // u, offload=off)
        return lambda: fpdt_attention(x, wq, None, wp, None, spec, cfg, pool=pool).backward(dy)

    variants = {(u, off): fpdt(u, off) for u in chunks for off in ([False, True] if offload else [False])}

    def run(fn):
        t = clock.time(fn)
        x.grad = wq.grad = wp.grad = None
        return t

    for fn in [plain] + list(variants.values()):
        run(fn)
    t_plain = {k: [] for k in variants}
    t_fpdt = {k: [] for k in variants}
    for r in range(rounds):
        for k, fn in variants.items():
            pair = [(t_plain, plain), (t_fpdt, fn)]
            for store, f in pair if r % 2 == 0 else reversed(pair):
                store[k].append(run(f))
    flops = attention_flops(seq, shape.batch, shape.heads, shape.head_dim)
    rows = []
    for k in variants:
        a, b = t_plain[k], t_fpdt[k]
        rows.append(
            dict(
                chunks=k[0],
                offload=k[1],
                plain_s=statistics.median(a),
                fpdt_s=statistics.median(b),
                ratio=statistics.median(y / x_ for x_, y in zip(a, b)),
                plain_attn_tflops=flops / statistics.median(a) / 1e12,
                fpdt_attn_tflops=flops / statistics.median(b) / 1e12,
            )
        )
    return rows


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--seq", type=int, default=32768, help="sequence for the overhead section")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=65536, help="FPDT chunk size for the longest-sequence search")
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--start-seq", type=int, default=32768)
    ap.add_argument("--max-seq", type=int, default=524288)
    ap.add_argument("--bisect-steps", type=int, default=2)
    ap.add_argument("--block", type=int, default=8192, help="block (chunk) length for the per-kernel timing")
    ap.add_argument("--skip", nargs="*", default=[], choices=["check", "kernels", "overhead", "longest"])
    return ap.parse_args(argv)


def _check_section(results, lines, device, dtype, shape):
    results["check"] = kernel_check(device, dtype, shape.head_dim)
    lines.append("")
    for key, err in results["check"]["each"].items():
        lines.append(f"  {key}: max |err| vs math kernel {err:.3g}" if isinstance(err, float) else f"  {key}: {err}")
    lines.append(f"kernel {results['check']['kernel']}: max |err| vs math kernel {results['check']['max_abs_err_vs_math']:.3g}")


def _kernels_section(results, lines, device, dtype, shape, args):
    rows = kernel_speed(device, dtype, shape, args.block, args.rounds)
    results["kernels"] = rows
    lines += [f"\none block fwd+bwd per kernel, sq = sk = {args.block}, heads {shape.heads}/{shape.groups}, "
              f"d {shape.head_dim}, {dtype} (median of {args.rounds})",
              "| kernel | causal | ms | TFLOP/s | grouped heads |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['causal']} | " + (
            f"{r['ms']:.2f} | {r['tflops']:.3g} | {r['gqa']} |" if "ms" in r else f"{r['error']} | | |"))
    print("\n".join(lines[-len(rows) - 3 :]), flush=True)


def _overhead_section(results, lines, device, dtype, shape, args):
    rows = overhead(device, dtype, shape, args.seq, args.chunks, args.rounds, offload=True)
    results["overhead"] = rows
    lines += [
        f"\nattention layer fwd+bwd, S={args.seq}, {args.rounds} alternating rounds (attention-core model TFLOP/s)",
        "| chunks | offload | plain s | FPDT s | ratio | plain TFLOP/s | FPDT TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunks']} | {r['offload']} | {r['plain_s']:.4f} | {r['fpdt_s']:.4f} | {r['ratio']:.3f} | "
            f"{r['plain_attn_tflops']:.3g} | {r['fpdt_attn_tflops']:.3g} |"
        )
    print("\n".join(lines[-len(rows) - 3 :]), flush=True)


def _longest_section(results, lines, device, dtype, shape, args):
    budget = args.budget_gib * GiB
    results["longest"] = {}
    lines += [f"\nlongest S within {args.budget_gib:g} GiB (layer fwd+bwd, FPDT chunk {args.chunk})", "| method | longest S | probes |", "|---|---|---|"]
    for method in ("plain", "fpdt", "fpdt_offload"):
        best, probes = longest_bounded(device, dtype, shape, method, args.chunk, budget, args.start_seq, args.max_seq, args.bisect_steps)
        results["longest"][method] = dict(best=best, probes=probes)
        cells = " ".join(f"{p['seq']}:{p['gib']:.1f}" for p in probes)
        lines.append(f"| {method} | {best}{' (cap)' if best >= args.max_seq else ''} | {cells} |")


def main(argv=None):
    args = _parse(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = LLAMA3_8B
    if args.tiny:
        shape = LayerShape(hidden=128, heads=4, groups=2, head_dim=32, ffn=256)
        args.seq, args.chunk, args.start_seq, args.max_seq, args.block = 1024, 256, 256, 2048, 256
        args.budget_gib = min(args.budget_gib, 0.05)  # CPU: peak RSS is per process, so only a smoke run
    if device.type == "cuda":
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu x{torch.get_num_threads()} threads"
    cmd = f"python -m bench.fpdt_gpu {' '.join(sys.argv[1:] if argv is None else argv)}"
    results = dict(command=cmd, device=name, dtype=str(dtype), shape=shape.__dict__, date=time.strftime("%Y-%m-%d"))
    lines = [f"# {cmd}", f"# device {name}, {dtype}, layer {shape}"]
    if "check" not in args.skip:
        _check_section(results, lines, device, dtype, shape)
    if "kernels" not in args.skip and device.type == "cuda":
        _kernels_section(results, lines, device, dtype, shape, args)
    if "overhead" not in args.skip:
        _overhead_section(results, lines, device, dtype, shape, args)
    if "longest" not in args.skip:
        _longest_section(results, lines, device, dtype, shape, args)

    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fpdt_gpu.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "fpdt_gpu.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


def longest_bounded(device, dtype, shape, method, chunk, budget, start, max_seq, bisect_steps):
    """Doubling from ``start`` up to ``max_seq``, then at most ``bisect_steps`` bisection
    probes (multiples of ``chunk``): each probe at these lengths can take a minute."""
    mem = Memory(device)
    probes = []

    def fits(seq):
        base = mem.reset()
        t0 = time.perf_counter()
        used, ok = float("nan"), False
        try:
            params = make_params(shape, dtype, device)
            cs = min(chunk, seq) if method.startswith("fpdt") else None
            layer = Layer(shape, params, method, None, chunk_size=cs)
            x = torch.randn(seq, shape.batch, shape.hidden, device=device, dtype=dtype, requires_grad=True)
            layer(x).backward(torch.randn_like(x))
            if device.type == "cuda":
                torch.cuda.synchronize()
            used = mem.peak() - base
            ok = used <= budget
        except torch.cuda.OutOfMemoryError:
            pass
        finally:
            params = layer = x = None  # noqa: F841
            mem.reset()
        probes.append(dict(seq=seq, gib=used / GiB, fits=ok, seconds=round(time.perf_counter() - t0, 2)))
        print(f"  {method} S={seq}: {used / GiB:.2f} GiB {'fits' if ok else 'over'} ({probes[-1]['seconds']}s)", flush=True)
        return ok

    if not fits(start):
        return 0, probes
    lo, hi = start, None
    while lo * 2 <= max_seq:
        if fits(lo * 2):
            lo *= 2
        else:
            hi = lo * 2
            break
    for _ in range(bisect_steps if hi is not None else 0):
        mid = (lo + hi) // 2 // chunk * chunk
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


if __name__ == "__main__":
    main()
