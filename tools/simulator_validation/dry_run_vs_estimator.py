#!/usr/bin/env python
"""The simulator's memory estimator and byte model against python -m tools.dry_run, per category.

    python -m tools.simulator_validation.dry_run_vs_estimator [--scale small,medium] \
        [--schedule none,1f1b,...] [--fpdt off,ulysses,fpdt,offload] [--json]

Each case runs the dry run (one real iteration of one rank under fake tensors) in its own
process and prints, per category, the dry run's bytes, the estimator's and the error
(estimator / dry run - 1). The state roles are compared at the accelerator peak; the
activations, WeiPipe buffers and FPDT chunk state at each role's own peak (what the
estimator gives per role); host bytes at their peak; sent bytes per iteration. Exit 1
when any category of any case is off by more than --tolerance (default 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megatron_weipipe.model_config import ATTENTION_BACKENDS
from megatron_weipipe.schedules import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers",
              "fpdt_chunk_state", "host", "sent", "peak")
AT_PEAK = ("parameters", "gradients", "optimizer_state")
SCHEDULES = registry.names()
FPDT_MODES = ("off", "ulysses", "fpdt", "offload")

COMMON = ("--tokenizer-type NullTokenizer --mock-data --lr 1e-4 --train-iters 1 --bf16 --hidden-dropout 0 "
          "--attention-dropout 0 --swiglu --normalization RMSNorm --disable-bias-linear "
          "--position-embedding-type rope --untie-embeddings-and-output-weights").split()
# name -> (model flags, sequence length, micro-batch size)
SCALES = {
    "small": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 176 --vocab-size 1024", 512, 2),
    "medium": ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
               "--num-query-groups 4 --ffn-hidden-size 2816 --vocab-size 32000", 8192, 1),
    "large": ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
              "--num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256", 131072, 1),
}


def case_flags(scale: str, schedule: str, fpdt: str) -> tuple[list[str], int, int]:
    """Flags, world size and rank of one case: 2 pipeline ranks (rank 1: it holds the loss
    for Megatron's schedules, and a ring rank for WeiPipe's) and CP = 2 with Ulysses/FPDT
    (4 chunks of the sequence)."""
    model, seq, mbs = SCALES[scale]
    flags = COMMON + model.split() + ["--seq-length", str(seq), "--max-position-embeddings", str(seq),
                                      "--micro-batch-size", str(mbs)]
    pipelined = registry.entry(schedule).pipelined
    pp = 2 if pipelined else 1
    cp = 1 if fpdt == "off" else 2
    micro = 4 if pipelined else 1
    flags += ["--global-batch-size", str(mbs * micro)]
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule]
        if registry.entry(schedule).virtual_stages:
            flags += ["--num-layers-per-virtual-pipeline-stage", str(int(model.split()[1]) // 4)]
    if cp > 1:
        flags += ["--context-parallel-size", str(cp)]
    if fpdt in ("fpdt", "offload"):
        flags += ["--fpdt", "--fpdt-chunk-size", str(seq // 4)]
    if fpdt == "offload":
        flags += ["--fpdt-offload"]
    if scale == "large":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--use-distributed-optimizer"]
    return flags, pp * cp, 1 if pp > 1 else 0


def compare(out: dict) -> dict:
    """category -> (dry run, estimator, error) from one dry run's --json object."""
    est = out["estimator"]
    rows = {}
    for c in CATEGORIES[:6]:
        got = out["categories"][c] if c in AT_PEAK else out["category_peaks"][c]
        rows[c] = (got, est["categories"][c])
    rows["host"] = (out["host_bytes"], est["host_bytes"])
    rows["sent"] = (out["sent_bytes"], est["sent_bytes"])
    rows["peak"] = (out["peak_accelerator_bytes"], est["peak_accelerator_bytes"])
    return {c: (g, w, error(g, w)) for c, (g, w) in rows.items()}


def error(got: int, want: int) -> float:
    if got == 0:
        return 0.0 if want == 0 else float("inf")
    return want / got - 1


def run_case(flags: list[str], world: int, rank: int, timeout: int = 1200) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tools.dry_run", *flags, "--world-size", str(world),
           "--rank", str(rank), "--json"]
    started = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"dry run failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout)
    out["wall_s"] = round(time.time() - started, 1)
    return out


def _fmt(err: float) -> str:
    return "inf" if err == float("inf") else f"{100 * err:+.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="small,medium")
    ap.add_argument("--schedule", default=",".join(SCHEDULES))
    ap.add_argument("--fpdt", default=",".join(FPDT_MODES))
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                    help="the model's core attention (auto: torch's fused kernel on this host; unfused: s x s)")
    a = ap.parse_args(argv)
    cases, worst = [], 0.0
    print("| scale | schedule | FPDT | " + " | ".join(CATEGORIES) + " | wall s |")
    print("|---" * (len(CATEGORIES) + 4) + "|")
    for scale in a.scale.split(","):
        for schedule in a.schedule.split(","):
            for fpdt in a.fpdt.split(","):
                flags, world, rank = case_flags(scale, schedule, fpdt)
                flags = flags + ["--attention-backend", a.attention_backend]
                out = run_case(flags, world, rank)
                rows = compare(out)
                cases.append({"scale": scale, "schedule": schedule, "fpdt": fpdt, "world_size": world, "rank": rank,
                              "flags": flags, "rows": rows, "wall_s": out["wall_s"]})
                worst = max([worst] + [abs(r[2]) for r in rows.values()])
                cells = " | ".join(_fmt(rows[c][2]) for c in CATEGORIES)
                print(f"| {scale} | {schedule} | {fpdt} | {cells} | {out['wall_s']} |", flush=True)
    if a.json:
        print(json.dumps(cases))
    print(f"worst error: {_fmt(worst)} (tolerance {100 * a.tolerance:.0f}%)")
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
