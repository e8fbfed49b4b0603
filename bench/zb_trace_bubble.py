"""Planned vs measured bubble of weipipe-interleave and weipipe-zb, from per-action traces.

Each (schedule, G, round) is one `torchrun --nproc-per-node 2 pretrain_gpt.py
--pipeline-schedule S --schedule-trace DIR` (a ring of P=2, each rank pinned to its own
core by bench/pinned_rank.py, OMP_NUM_THREADS=1), rounds rotating the order of the
schedules. From the traces (timing/measured.py; every iteration but the first, optimizer
step excluded): the measured bubble, the mean iteration time, the mean cost of each
compute kind, and the planned bubble, which is the simulator on the schedule's plan at
those measured costs. The zb / interleave ratio of iteration times is taken per round
(both ran back to back) and its median reported, and the ratio of the fastest
iteration of each schedule over all rounds (the least disturbed by other load). See shared/design/MEASURING.md: on
shared CPUs only ratios within a round and medians mean much.

  OMP_NUM_THREADS=1 python -m bench.zb_trace_bubble --Gs 2 4 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from megatron_weipipe.schedules.timing import measured
from tools.schedule_timeline import planned_from_trace

SCHEDULES = ("weipipe-interleave", "weipipe-zb")


def flags(schedule: str, G: int, args) -> list[str]:
    P = 2
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--micro-batch-size", "1", "--global-batch-size", str(G * P), "--train-iters", str(args.iters),
        "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--pipeline-model-parallel-size", str(P), "--pipeline-schedule", schedule,
        "--data-path", os.path.join(ROOT, "data", "sample_text_document"), "--tokenizer-type", "ByteLevelTokenizer",
        "--log-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
    ]


def run_one(schedule: str, G: int, args, port: int) -> dict:
    with tempfile.TemporaryDirectory() as trace_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "bench.pinned_rank", *flags(schedule, G, args),
               "--schedule-trace", trace_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{schedule} G={G} failed:\n{proc.stderr[-3000:]}")
        m = measured.measure(measured.load(trace_dir))
        total = m.busy_s + m.idle_s
        split = {k: sum(getattr(r, f"{k}_s") for r in m.ranks) / total for k in ("wait", "send", "other")}
        _, at_costs, unit = planned_from_trace(m)
        return {"measured": m.measured_bubble, "planned": at_costs.bubble_fraction, "unit": unit.bubble_fraction,
                "iter_s": statistics.mean(m.iteration_s), "iter_min_s": min(m.iteration_s), "costs": m.mean_cost_s, "split": split,
                "wgrad_peak_bytes": max(t.meta.get("wgrad_peak_bytes", 0) for t in measured.load(trace_dir))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--Gs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=4, help="training iterations per run (the first is not measured)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    print("command: OMP_NUM_THREADS=1 python -m bench.zb_trace_bubble " + " ".join(sys.argv[1:]))
    results = {}
    port = 29600
    for r in range(args.rounds):
        for G in args.Gs:
            order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
            for s in order:
                port += 1
                results[(s, G, r)] = res = run_one(s, G, args, port)
                print(f"round {r} G={G} {s}: measured {res['measured']:.4f} planned {res['planned']:.4f} "
                      f"iteration {res['iter_s']:.3f} s", flush=True)
    print(f"\nP=2, L={args.layers}, h={args.hidden}, seq={args.seq}, micro-batch 1, float32, gloo, "
          f"{args.rounds} rounds, medians")
    print("| schedule | G | planned bubble (unit costs) | planned bubble (measured costs) | measured bubble "
          "| of which recv wait / send post / rest | iteration s | F / I / W / B ms |")
    print("|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for G in args.Gs:
        for s in SCHEDULES:
            rs = [results[(s, G, r)] for r in range(args.rounds)]
            costs = {k: med(x["costs"].get(k, 0.0) for x in rs) * 1e3 for k in
                     ("forward", "backward_input", "backward_weight", "backward")}
            print(f"| {s} | {G} | {100 * rs[0]['unit']:.1f}% | {100 * med(x['planned'] for x in rs):.1f}% "
                  f"| {100 * med(x['measured'] for x in rs):.1f}% "
                  f"| {100 * med(x['split']['wait'] for x in rs):.1f} / {100 * med(x['split']['send'] for x in rs):.1f} / "
                  f"{100 * med(x['measured'] - x['split']['wait'] - x['split']['send'] for x in rs):.1f}% "
                  f"| {med(x['iter_s'] for x in rs):.3f} "
                  f"| {costs['forward']:.1f} / {costs['backward_input']:.1f} / {costs['backward_weight']:.1f} / "
                  f"{costs['backward']:.1f} |")
    peak = max(x["wgrad_peak_bytes"] for (s, _, _), x in results.items() if s == "weipipe-zb")
    print(f"\nmost bytes the deferred weight gradients of weipipe-zb kept at once on a rank: {peak} "
          f"({peak / 2**20:.2f} MiB)")
    print("\n| G | zb / interleave iteration time: median of per-round ratios (each round's) "
          "| ratio of the fastest iterations (least disturbed) |")
    print("|---|---|---|")
    for G in args.Gs:
        ratios = [results[("weipipe-zb", G, r)]["iter_s"] / results[("weipipe-interleave", G, r)]["iter_s"]
                  for r in range(args.rounds)]
        fastest = (min(results[("weipipe-zb", G, r)]["iter_min_s"] for r in range(args.rounds))
                   / min(results[("weipipe-interleave", G, r)]["iter_min_s"] for r in range(args.rounds)))
        print(f"| {G} | {med(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}) | {fastest:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
