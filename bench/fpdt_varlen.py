"""Packed documents: what skipping cross-document work saves, and how masked blocks run.

One process (CP = 1), FPDT attention forward + backward on S tokens in chunks of C, as one
causal sequence (unpacked) and as packed documents of random length (uniform in
[1, 2*mean-1], seeded). A masked block (one a document boundary cuts) runs three ways:

  loop     the backend's kernel once per document rectangle (a Python loop per document)
  mask     the math kernel on the whole block with a boolean document mask
  varlen   one call over all the block's rectangles (fpdt/varlen.py; on the CPU the
           padded reference, on a GPU flash varlen)

(``auto``, the default, takes varlen unless the padding would exceed the block: mask.)
Reported per layout: chunk pairs computed and skipped, the attention score entries
computed per head (unpacked: S(S+1)/2; packed: every computed block's entries, masked
blocks counted as their document rectangles only) and their ratio, which is the FLOP
ratio of the attention matmuls; and per mode the median time over alternating rounds
after a warm-up, and the median of the pairwise ratios to the unpacked run.

  OMP_NUM_THREADS=1 python -m bench.fpdt_varlen --seq 8192 --chunk 1024 --means 256 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

MODES = ("loop", "mask", "varlen")


def document_lengths(seq: int, mean: int, seed: int = 7) -> list[int]:
    import random

    rng, out, left = random.Random(seed), [], seq
    while left > 0:
        out.append(min(left, rng.randint(1, 2 * mean - 1)))
        left -= out[-1]
    return out


def score_entries(offsets: torch.Tensor | None, seq: int, chunk: int) -> int:
    """Score entries per head the chunk loop computes (independent of the kernels)."""
    from megatron_weipipe.fpdt.documents import CAUSAL, FULL, MASKED, SKIP, Documents

    u = seq // chunk
    if offsets is None:
        return seq * (seq + 1) // 2
    docs, total = Documents(offsets), 0
    for i in range(u):
        for j in range(i + 1):
            rng = (i * chunk, (i + 1) * chunk, j * chunk, (j + 1) * chunk)
            kind = docs.classify(*rng)
            if kind == FULL:
                total += chunk * chunk
            elif kind == CAUSAL:
                total += chunk * (chunk + 1) // 2
            elif kind == MASKED:
                for qa, qe, ka, ke in docs.segments(*rng)[0]:
                    total += (qe - qa) * (qe - qa + 1) // 2 if i == j else (qe - qa) * (ke - ka)
            else:
                assert kind == SKIP
    return total


def _loop_mode():
    """The per-document loop, as the masked blocks ran before the varlen path."""
    from megatron_weipipe.fpdt.kernels import acc_dtype

    def fwd(kern, q, k, v, kind, docs, rng, scale):
        if kind != "masked":
            return kern.forward(q, k, v, kind == "causal", scale)
        causal = rng[0] == rng[2]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype))
        for r, row in enumerate(docs.segments(*rng)):
            for qa, qe, ka, ke in row:
                o, l = kern.forward(q[r:r + 1, :, qa:qe], k[r:r + 1, :, ka:ke], v[r:r + 1, :, ka:ke], causal, scale)
                out[r:r + 1, :, qa:qe], lse[r:r + 1, :, qa:qe] = o, l
        return out, lse

    def bwd(kern, do, q, k, v, o, lse, kind, docs, rng, scale):
        if kind != "masked":
            return kern.backward(do, q, k, v, o, lse, kind == "causal", scale)
        causal = rng[0] == rng[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for r, row in enumerate(docs.segments(*rng)):
            for qa, qe, ka, ke in row:
                s = slice(r, r + 1)
                g = kern.backward(do[s, :, qa:qe], q[s, :, qa:qe], k[s, :, ka:ke], v[s, :, ka:ke],
                                  o[s, :, qa:qe], lse[s, :, qa:qe], causal, scale)
                dq[s, :, qa:qe], dk[s, :, ka:ke], dv[s, :, ka:ke] = g
        return dq, dk, dv

    return fwd, bwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--means", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)

    from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, RotaryConfig, fpdt_attention
    from megatron_weipipe.fpdt import chunked_attention, packed
    from megatron_weipipe.fpdt.documents import Documents

    print(f"# command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m bench.fpdt_varlen "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; FPDT attention fwd+bwd, CP=1, S={args.seq}, "
          f"C={args.chunk}, hidden {args.hidden}, {args.heads} heads, {args.groups} KV heads, d {args.head_dim}, float32")
    spec = AttentionSpec(args.hidden, args.heads, args.head_dim, args.groups, rotary=RotaryConfig(base=500000.0))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.seq, 1, args.hidden, generator=g).requires_grad_(True)
    dy = torch.randn(args.seq, 1, args.hidden, generator=g)
    wq = (torch.randn(spec.qkv_size, args.hidden, generator=g) * args.hidden**-0.5).requires_grad_(True)
    wp = (torch.randn(args.hidden, spec.proj_input_size, generator=g) * 0.05).requires_grad_(True)
    cfg = FPDTConfig(chunk_size=args.chunk)
    offsets = {m: torch.tensor([[0] + torch.tensor(document_lengths(args.seq, m)).cumsum(0).tolist()])
               for m in args.means}
    plain = (chunked_attention.block_forward, chunked_attention.block_backward)
    loop = _loop_mode()
    counts = {}

    def run(mean, mode):
        if mode == "loop":
            chunked_attention.block_forward, chunked_attention.block_backward = loop
        else:
            chunked_attention.block_forward, chunked_attention.block_backward = plain
            packed.PAD_RATIO = 0.0 if mode == "mask" else float("inf")
        docs = None if mean is None else Documents(offsets[mean])
        t0 = time.perf_counter()
        fpdt_attention(x, wq, None, wp, None, spec, cfg, documents=docs).backward(dy)
        dt = time.perf_counter() - t0
        x.grad = wq.grad = wp.grad = None
        if docs is not None:
            counts[mean] = dict(docs.counts)
        return dt

    variants = [(None, "varlen")] + [(m, mode) for m in args.means for mode in MODES]
    for v in variants:
        run(*v)  # warm-up
    times: dict = {}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            times.setdefault(v, []).append(run(*v))
    chunked_attention.block_forward, chunked_attention.block_backward = plain
    packed.PAD_RATIO = 1.0

    base = times[(None, "varlen")]
    full = score_entries(None, args.seq, args.chunk)
    u = args.seq // args.chunk
    print("\n| documents | chunk pairs computed (masked) | skipped | score entries / head | FLOP ratio "
          "| masked blocks | median time (s) | time / unpacked |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| one ({args.seq}) | {u * (u + 1) // 2} (0) | 0 | {full} | 1 | - | {statistics.median(base):.3f} | 1 |")
    for m in args.means:
        c, n = counts[m], len(document_lengths(args.seq, m))
        done = c.get("full", 0) + c.get("causal", 0) + c.get("masked", 0)
        e = score_entries(offsets[m], args.seq, args.chunk)
        for mode in MODES:
            t = times[(m, mode)]
            ratio = statistics.median(b / a for a, b in zip(base, t))
            print(f"| {n} of mean {m} | {done} ({c.get('masked', 0)}) | {c.get('skip', 0)} | {e} | {e / full:.3f} "
                  f"| {mode} | {statistics.median(t):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
