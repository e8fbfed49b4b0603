"""Predicted vs measured on this CPU host, alternating so that drifting load hits both.

For every (ranks, sequence length) block and every round: calibrate (real megatron-core
layers of the shape, the cores P ranks get, gloo's speed) with `tools/simulate.py
--calibrate --measure-host`, then run each schedule for real with torchrun; the next
block calibrates again. The schedule order rotates per round. Each prediction is paired
with the measurement of its own round; the table reports medians over rounds, the
measurement spread, and the byte counter against the predicted bytes (exact).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .probe_run import REPO
from .realruns import real_run
from .shape import ModelShape

SCHEDULES = ("1f1b", "weipipe-naive", "weipipe-interleave", "weipipe-zb")


@dataclass(frozen=True)
class Block:
    ranks: int
    seq_length: int
    microbatches_per_rank: int = 2

    def shape(self, base: ModelShape) -> ModelShape:
        from dataclasses import replace

        return replace(base, seq_length=self.seq_length)


BASE = ModelShape(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=2,
                  vocab_size=1025)
BLOCKS = (Block(2, 256), Block(2, 1024), Block(4, 256), Block(4, 1024))


def simulate_flags(shape: ModelShape, ranks: int, global_batch: int, schedules) -> list[str]:
    return [
        "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
        "--num-attention-heads", str(shape.num_attention_heads), "--seq-length", str(shape.seq_length),
        "--micro-batch-size", str(shape.micro_batch_size), "--global-batch-size", str(global_batch),
        "--vocab-size", str(shape.vocab_size), "--pipeline-model-parallel-size", str(ranks),
        "--fp32", "--no-dropout", "--schedules", ",".join(schedules), "--calibrate", "--measure-host",
    ]


def predict(shape: ModelShape, ranks: int, global_batch: int, schedules) -> tuple[dict, str, str]:
    """{schedule: result dict} from a fresh `tools/simulate.py --calibrate` process."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "pred.json")
        cal = os.path.join(d, "cal.json")
        flags = simulate_flags(shape, ranks, global_batch, schedules) + ["--json", out, "--calibration", cal]
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "simulate.py"), *flags], cwd=REPO,
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1])
        with open(out) as f:
            results = {r["schedule"]: r for r in json.load(f)}
        with open(cal) as f:
            calibration = f.read()
    host = next((ln for ln in proc.stdout.splitlines() if ln.startswith("host:")), "")
    return results, host, calibration


def run_validation(path: str, rounds: int = 3, blocks=BLOCKS, schedules=SCHEDULES, base: ModelShape = BASE) -> None:
    """Append one JSON record per (round, block, schedule) to `path`."""
    for rnd in range(rounds):
        order = list(schedules[rnd % len(schedules):]) + list(schedules[:rnd % len(schedules)])
        for block in blocks:
            shape = block.shape(base)
            gbs = shape.micro_batch_size * block.ranks * block.microbatches_per_rank
            t0 = time.time()
            pred, host, _ = predict(shape, block.ranks, gbs, schedules)
            for name in order:
                run = real_run(shape, block.ranks, name, gbs)
                record = {"round": rnd, "ranks": block.ranks, "seq_length": block.seq_length,
                          "schedule": name, "predicted_ms": pred[name]["iteration_s"] * 1e3,
                          "measured_ms": run.elapsed_ms, "predicted_counter": pred[name]["counter"],
                          "measured_sent": run.sent, "log_sent": run.log_sent, "host": host,
                          "command": run.command, "calibrated_at": t0, "loadavg": os.getloadavg()[0]}
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"round {rnd} P={block.ranks} s={block.seq_length} {name}: predicted "
                      f"{record['predicted_ms']:.0f} ms, measured {run.elapsed_ms:.0f} ms ({host})", flush=True)


def load_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bytes_equal(rec: dict) -> bool:
    """Predicted counter bytes equal the run's byte counter, every rank and kind."""
    measured = {int(k): v for k, v in rec["measured_sent"].items()}
    for rank, row in enumerate(rec["predicted_counter"]):
        got = {k: v for k, v in measured.get(rank, {}).items() if v}
        if got != {k: v for k, v in row.items() if v}:
            return False
    return True


def summarise(records: list[dict]) -> list[dict]:
    rows = {}
    for r in records:
        key = (r["ranks"], r["seq_length"], r["schedule"])
        rows.setdefault(key, []).append(r)
    out = []
    for (ranks, seq, name), recs in sorted(rows.items()):
        meas = [r["measured_ms"] for r in recs]
        pred = [r["predicted_ms"] for r in recs]
        ratios = [p / m for p, m in zip(pred, meas)]
        med_m = statistics.median(meas)
        out.append({
            "ranks": ranks, "seq_length": seq, "schedule": name, "rounds": len(recs),
            "measured_ms": med_m, "predicted_ms": statistics.median(pred),
            "error": statistics.median(ratios) - 1.0,
            "spread": (max(meas) - min(meas)) / med_m if med_m else 0.0,
            "bytes_exact": all(bytes_equal(r) for r in recs),
            "log_sent": recs[-1]["log_sent"],
            "loadavg": statistics.median(r.get("loadavg", 0.0) for r in recs),
        })
    return out

