"""Time of FPDT attention (forward + backward) over plain Ulysses at 1, 2, 4, 8 chunks.

Both run in the same processes, alternately (Ulysses, FPDT-u, Ulysses, FPDT-u, ...) after
a warm-up, several rounds; reported: median time of each and the median of the pairwise
ratios FPDT/Ulysses (see MEASURING.md: ratios in one run, never absolute times across
runs). Each timing is the slowest rank's, between barriers. One process per core: on a
2-core host use --cp 2 (or 1). Attention layer only (projections, all-to-alls, rotary,
block kernel), float32 with the CPU flash kernel unless --kernel says otherwise.

  OMP_NUM_THREADS=1 python -m bench.fpdt_overhead --seq 4096 --cp 2 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from bench import fpdt_util
from tests.harness import run_distributed


def _rank(rank, world, args):
    import torch.distributed as dist

    from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, HostBufferPool, RotaryConfig, fpdt_attention, ulysses_attention

    group = dist.group.WORLD if world > 1 else None
    spec = AttentionSpec(args.hidden, args.heads, args.head_dim, args.groups, rotary=RotaryConfig(base=500000.0))
    g = torch.Generator().manual_seed(rank)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.seq // world, 1, args.hidden, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(args.seq // world, 1, args.hidden, generator=g).to(dtype)
    wq = (torch.randn(spec.qkv_size, args.hidden, generator=g) * args.hidden**-0.5).to(dtype).requires_grad_(True)
    wp = (torch.randn(args.hidden, spec.proj_input_size, generator=g) * 0.05).to(dtype).requires_grad_(True)
    pool = HostBufferPool()

    def ulysses():
        ulysses_attention(x, wq, None, wp, None, spec, group, kernel=args.kernel).backward(dy)

    def fpdt(u):
        cfg = FPDTConfig(chunk_size=args.seq // u, offload=args.offload, kernel=args.kernel)
        return lambda: fpdt_attention(x, wq, None, wp, None, spec, cfg, group, pool=pool).backward(dy)

    def timed(fn):
        t = fpdt_util.timed(fn, group)
        x.grad = wq.grad = wp.grad = None
        return t

    variants = {u: fpdt(u) for u in args.chunks}
    for fn in [ulysses] + list(variants.values()):  # warm-up
        timed(fn)
    times = {"ulysses": {u: [] for u in args.chunks}, "fpdt": {u: [] for u in args.chunks}}
    for r in range(args.rounds):
        for u, fn in variants.items():
            order = [("ulysses", ulysses), ("fpdt", fn)]
            if r % 2:  # alternate which goes first
                order.reverse()
            for name, f in order:
                times[name][u].append(timed(f))
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--offload", action="store_true")
    args = ap.parse_args(argv)
    print(f"# command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m bench.fpdt_overhead {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# attention layer S={args.seq} CP={args.cp} hidden={args.hidden} heads={args.heads} kv={args.groups} d={args.head_dim} {args.dtype} offload={args.offload}; {args.rounds} alternating rounds, slowest rank")
    times = run_distributed(_rank, args.cp, args, timeout=3600)[0]
    print("\n| chunks u | Ulysses median (s) | FPDT median (s) | median ratio FPDT/Ulysses | ratio of minima |")
    print("|---|---|---|---|---|")
    for u in args.chunks:
        a, b = times["ulysses"][u], times["fpdt"][u]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"| {u} | {statistics.median(a):.4f} | {statistics.median(b):.4f} | {ratio:.3f} | {min(b) / min(a):.3f} |")


if __name__ == "__main__":
    main()
