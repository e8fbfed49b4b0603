"""Peak memory of one transformer layer (forward + backward) for plain attention, Ulysses,
FPDT and FPDT + offload at growing sequence lengths; the longest sequence each fits in a
budget; chunked vs unchunked output layer + cross-entropy at a 128K vocabulary.

Every configuration runs in fresh processes (one per context-parallel rank, gloo on CPU).
CPU: peak resident set (ru_maxrss) minus the RSS of the same process right before the
layer's tensors are created, maximum over ranks. CUDA (--device cuda, one device, P=1):
torch.cuda.max_memory_allocated after reset_peak_memory_stats. "chunk state" is the exact
count of FPDT's saved per-chunk tensors held on the compute device at peak (OffloadStats).
On a CPU host offloading copies to the same memory, so its RSS cannot drop: the counted
chunk state is the number that shows what offload saves on a GPU.

Example (the command printed with the tables):
  OMP_NUM_THREADS=1 python -m bench.fpdt_memory --seqs 2048 4096 8192 --budget-mib 160
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench.fpdt_util import METHODS, Layer, LayerShape, longest_fitting, make_params, peak_rss_bytes, rss_bytes
from tests.harness import run_distributed

MiB = 2**20


def _layer_rank(rank, world, shape, method, seq, chunk, device):
    import torch.distributed as dist

    torch.manual_seed(rank)
    cuda = device == "cuda"
    group = dist.group.WORLD if world > 1 else None
    _warm_up(shape, method, world, chunk, device, group)
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    params = make_params(shape, torch.float32 if not cuda else torch.bfloat16, device)
    layer = Layer(shape, params, method, group, chunk_size=chunk if method.startswith("fpdt") else None)
    x = torch.randn(seq // world, shape.batch, shape.hidden, device=device, dtype=params["wq"].dtype, requires_grad=True)
    t0 = time.perf_counter()
    layer(x).backward(torch.randn(seq // world, shape.batch, shape.hidden, device=device, dtype=x.dtype))
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    return dict(peak=peak - base, chunk_state=layer.stats.peak_device_bytes, seconds=elapsed)


def _warm_up(shape, method, world, chunk, device, group):
    """One tiny step first, so library initialisation is part of the baseline."""
    import gc

    dtype = torch.float32 if device != "cuda" else torch.bfloat16
    params = make_params(shape, dtype, device)
    seq = chunk * world
    layer = Layer(shape, params, method, group, chunk_size=chunk if method.startswith("fpdt") else None)
    x = torch.randn(seq // world, shape.batch, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    layer(x).sum().backward()
    del layer, x, params
    gc.collect()


def measure_layer(shape, method, seq, cp, chunk, device="cpu"):
    world = 1 if (method == "plain" or device == "cuda") else cp
    per_rank = run_distributed(_layer_rank, world, shape, method, seq, chunk, device, timeout=1800)
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


def _loss_rank(rank, world, seq, hidden, vocab, chunks):
    from megatron_weipipe.fpdt.loss import chunked_cross_entropy, reference_cross_entropy

    base = rss_bytes()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(seq, 1, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, seq), generator=g)
    if chunks:
        loss = chunked_cross_entropy(h, w, labels, num_chunks=chunks)
    else:
        loss = reference_cross_entropy(h, w, labels)
    loss.mean().backward()
    return peak_rss_bytes() - base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 4096, 8192], help="none: skip the table")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024, help="FPDT chunk size C (global tokens)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--budget-mib", type=float, default=160.0, help="0 skips the longest-sequence search")
    ap.add_argument("--max-seq", type=int, default=65536)
    ap.add_argument("--loss-seq", type=int, default=1024, help="0 skips the loss comparison")
    ap.add_argument("--loss-hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--loss-chunk", type=int, default=128)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    shape = LayerShape(args.hidden, args.heads, args.groups, args.head_dim, args.ffn, 1)
    unit = "max_memory_allocated" if args.device == "cuda" else "peak RSS - baseline"
    print(f"# command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m bench.fpdt_memory {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# layer {shape}, float32 on CPU / bf16 on CUDA, CP={args.cp} (plain: 1 rank), chunk C={args.chunk}; memory = {unit}, max over ranks")

    if args.seqs:
        print("\n| method | " + " | ".join(f"S={s}" for s in args.seqs) + " |")
        print("|---|" + "---|" * len(args.seqs))
    rows = {}
    for m in args.methods if args.seqs else []:
        rows[m] = [measure_layer(shape, m, s, args.cp, args.chunk, args.device) for s in args.seqs]
        cells = []
        for r in rows[m]:
            cell = f"{r['peak'] / MiB:.0f} MiB"
            if m.startswith("fpdt"):
                cell += f" (chunk state {r['chunk_state'] / MiB:.1f})"
            cells.append(cell)
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)

    if args.budget_mib > 0:
        print(f"\n| method | longest S within {args.budget_mib:.0f} MiB (multiple of {args.chunk}) | probes |")
        print("|---|---|---|")
        for m in args.methods:
            probes = []

            def fits(s, m=m):
                r = measure_layer(shape, m, s, args.cp, args.chunk, args.device)
                probes.append(f"{s}:{r['peak'] / MiB:.0f}")
                return r["peak"] <= args.budget_mib * MiB

            best = longest_fitting(fits, args.chunk * max(1, args.cp), args.chunk, args.max_seq)
            capped = " (cap)" if best >= args.max_seq else ""
            print(f"| {m} | {best}{capped} | {' '.join(probes)} |", flush=True)

    if args.loss_seq > 0 and args.device == "cpu":
        chunks = args.loss_seq // args.loss_chunk
        un = run_distributed(_loss_rank, 1, args.loss_seq, args.loss_hidden, args.vocab, 0, timeout=1800)[0]
        ch = run_distributed(_loss_rank, 1, args.loss_seq, args.loss_hidden, args.vocab, chunks, timeout=1800)[0]
        logits = args.loss_seq * args.vocab * 4 / MiB
        print(f"\n| output layer + CE, s={args.loss_seq}, V={args.vocab}, h={args.loss_hidden} | peak RSS - baseline |")
        print("|---|---|")
        print(f"| unchunked (fp32 logits [s, V] = {logits:.0f} MiB) | {un / MiB:.0f} MiB |")
        print(f"| chunked, {chunks} chunks of {args.loss_chunk} tokens | {ch / MiB:.0f} MiB |")


if __name__ == "__main__":
    main()
