"""How much cheaper FPDT attention is on packed short documents than on one long sequence.

For each chunk size, FPDT attention (forward + backward) runs on the same S tokens as one
causal sequence (no documents: the unpacked baseline) and as packed documents of random
length (uniform in [1, 2*mean-1], seeded, the same on every rank), alternately, several
rounds after a warm-up, in the same processes. Reported: chunk pairs computed (full,
causal or masked blocks) and skipped per forward, the median time, and the median of the
pairwise ratios packed/unpacked (MEASURING.md: ratios within one run). Slowest rank,
between barriers; one process per core.

  OMP_NUM_THREADS=1 python -m bench.fpdt_packed --seq 16384 --chunks 1024 2048 --means 1024 4096 --cp 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import torch

from bench import fpdt_util
from tests.harness import run_distributed


def document_lengths(seq: int, mean: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out, left = [], seq
    while left > 0:
        n = min(left, rng.randint(1, 2 * mean - 1))
        out.append(n)
        left -= n
    return out


def _rank(rank, world, args):
    import torch.distributed as dist

    from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, HostBufferPool, RotaryConfig, fpdt_attention
    from megatron_weipipe.fpdt.documents import Documents

    group = dist.group.WORLD if world > 1 else None
    spec = AttentionSpec(args.hidden, args.heads, args.head_dim, args.groups, rotary=RotaryConfig(base=500000.0))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.seq // world, 1, args.hidden, generator=g).requires_grad_(True)
    dy = torch.randn(args.seq // world, 1, args.hidden, generator=g)
    wq = (torch.randn(spec.qkv_size, args.hidden, generator=g) * args.hidden**-0.5).requires_grad_(True)
    wp = (torch.randn(args.hidden, spec.proj_input_size, generator=g) * 0.05).requires_grad_(True)
    pool = HostBufferPool()
    offsets = {m: torch.tensor([[0] + list(torch.tensor(document_lengths(args.seq, m, 7)).cumsum(0))]) for m in args.means}
    counts = {}

    def run(chunk, mean):
        cfg = FPDTConfig(chunk_size=chunk, offload=args.offload)

        def fn():
            docs = None if mean is None else Documents(offsets[mean])
            fpdt_attention(x, wq, None, wp, None, spec, cfg, group, pool=pool, documents=docs).backward(dy)
            if docs is not None:
                counts[(chunk, mean)] = dict(docs.counts)
        return fn

    def timed(fn):
        t = fpdt_util.timed(fn, group)
        x.grad = wq.grad = wp.grad = None
        return t

    times = {}
    for chunk in args.chunks:
        variants = [None] + list(args.means)
        for m in variants:  # warm-up
            timed(run(chunk, m))
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for m in order:
                times.setdefault((chunk, m), []).append(timed(run(chunk, m)))
    return times, counts, {m: len(document_lengths(args.seq, m, 7)) for m in args.means}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--means", type=int, nargs="+", default=[1024, 4096], help="mean document lengths")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--offload", action="store_true")
    args = ap.parse_args(argv)
    print(f"# command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m bench.fpdt_packed "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# FPDT attention fwd+bwd, S={args.seq} CP={args.cp} hidden={args.hidden} heads={args.heads} "
          f"kv={args.groups} d={args.head_dim} float32 offload={args.offload}; {args.rounds} alternating rounds")
    times, counts, ndocs = run_distributed(_rank, args.cp, args, timeout=3600)[0]
    print("\n| S | chunk C | documents | chunk pairs computed (masked) | skipped | median time (s) | packed / unpacked |")
    print("|---|---|---|---|---|---|---|")
    for chunk in args.chunks:
        u = args.seq // chunk
        base = times[(chunk, None)]
        print(f"| {args.seq} | {chunk} | one ({args.seq}) | {u * (u + 1) // 2} (0) | 0 | {statistics.median(base):.3f} | 1 |")
        for m in args.means:
            c = counts[(chunk, m)]
            done = c.get("full", 0) + c.get("causal", 0) + c.get("masked", 0)
            ratio = statistics.median(b / a for a, b in zip(base, times[(chunk, m)]))
            print(f"| {args.seq} | {chunk} | {ndocs[m]} of mean {m} | {done} ({c.get('masked', 0)}) | {c.get('skip', 0)} "
                  f"| {statistics.median(times[(chunk, m)]):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
