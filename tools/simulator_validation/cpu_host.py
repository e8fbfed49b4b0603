"""Predicted vs measured on this CPU host, calibrations and runs alternating.

For every round and (ranks, sequence length) block: calibrate, run a schedule,
calibrate, run the next schedule, ..., calibrate (schedule order rotated per round).
A calibration is `python -m tools.simulate --calibrate --calibrate-ranks P --measure-host`: P
processes time the real megatron-core layers of the shape at once, as the P ranks will
compute at once, so the wall times carry the contention between them and with whatever
else this shared host runs. Each run is predicted from the calibrations just before and
just after it (mean), since the host's load drifts on the scale of a run. The table
reports medians over rounds, the measurement spread, the CPU time per iteration (the
calibrations' CPU seconds replayed, against the ranks' measured process time, which
does not depend on the load), and the byte counter against the predicted bytes (exact).
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

from megatron_weipipe.shape import ModelShape

from tools.simulator_validation.probe_run import REPO
from tools.simulator_validation.realruns import real_run

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
        "--hidden-dropout", "0", "--attention-dropout", "0", "--schedules", ",".join(schedules),
    ]


def _simulate(flags: list[str]) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "pred.json")
        proc = subprocess.run([sys.executable, "-m", "tools.simulate", *flags, "--json", out],
                              cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1])
        with open(out) as f:
            results = {r["schedule"]: r for r in json.load(f)}
    host = next((ln for ln in proc.stdout.splitlines() if ln.startswith("host:")), "")
    return results, host


def run_validation(path: str, rounds: int = 3, blocks=BLOCKS, schedules=SCHEDULES, base: ModelShape = BASE,
                   workdir: str = "/tmp", repeats: int = 3) -> None:
    """Append one JSON record per (round, block, schedule) to `path`."""
    for rnd in range(rounds):
        order = list(schedules[rnd % len(schedules):]) + list(schedules[:rnd % len(schedules)])
        for block in blocks:
            shape = block.shape(base)
            gbs = shape.micro_batch_size * block.ranks * block.microbatches_per_rank
            flags = simulate_flags(shape, block.ranks, gbs, schedules)

            def calibrate(i: int):
                cal = os.path.join(workdir, f"simulator_cal_P{block.ranks}_s{block.seq_length}_r{rnd}_{i}.json")
                wall, host = _simulate(flags + ["--calibrate", "--calibrate-ranks", str(block.ranks),
                                                "--calibration-repeats", str(repeats), "--measure-host",
                                                "--calibration", cal])
                cpu, _ = _simulate(flags + ["--calibration", cal, "--calibration-clock", "cpu"])
                with open(cal) as f:
                    share = json.load(f)["cpu_share"]
                return wall, cpu, share, host

            before = calibrate(0)
            for i, name in enumerate(order):
                run = real_run(shape, block.ranks, name, gbs)
                after = calibrate(i + 1)
                pair = (before, after)
                record = {"round": rnd, "ranks": block.ranks, "seq_length": block.seq_length, "schedule": name,
                          "predicted_ms": statistics.mean(c[0][name]["iteration_s"] for c in pair) * 1e3,
                          "predicted_before_ms": before[0][name]["iteration_s"] * 1e3,
                          "predicted_after_ms": after[0][name]["iteration_s"] * 1e3,
                          "measured_ms": run.elapsed_ms,
                          "predicted_cpu_ms": [statistics.mean(c[1][name]["work_s"][r] for c in pair) * 1e3
                                               for r in range(block.ranks)],
                          "measured_cpu_ms": list(run.cpu_ms),
                          "predicted_counter": before[0][name]["counter"], "measured_sent": run.sent,
                          "log_sent": run.log_sent, "run_cpu_share": run.cpu_share,
                          "calibration_share": statistics.mean(c[2] for c in pair), "host": before[3],
                          "command": run.command, "loadavg": os.getloadavg()[0], "time": time.time()}
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"round {rnd} P={block.ranks} s={block.seq_length} {name}: predicted "
                      f"{record['predicted_ms']:.0f} ms (before {record['predicted_before_ms']:.0f}, after "
                      f"{record['predicted_after_ms']:.0f}), measured {run.elapsed_ms:.0f} ms; CPU/iter predicted "
                      f"{statistics.mean(record['predicted_cpu_ms']):.0f} ms, measured "
                      f"{statistics.mean(run.cpu_ms) if run.cpu_ms else float('nan'):.0f} ms; calibrations got "
                      f"{record['calibration_share']:.0%} of a core, the ranks {run.cpu_share:.0%}", flush=True)
                before = after


def calibration_paths(rec: dict, workdir: str, schedules=SCHEDULES) -> tuple[str, str]:
    """The calibrations taken right before and right after a record's run."""
    rnd = rec["round"]
    order = list(schedules[rnd % len(schedules):]) + list(schedules[:rnd % len(schedules)])
    i = order.index(rec["schedule"])
    stem = os.path.join(workdir, f"simulator_cal_P{rec['ranks']}_s{rec['seq_length']}_r{rnd}_")
    return stem + f"{i}.json", stem + f"{i + 1}.json"


def repredict(records: list[dict], workdir: str, extra: tuple = ("--calibration-clock", "cpu")) -> list[dict]:
    """Predictions of every record again from its saved calibrations, with the current
    model (CPU seconds and fair sharing unless `extra` says otherwise): nothing measured
    in the run goes into them."""
    cache: dict = {}
    out = []
    for rec in records:
        shape = Block(rec["ranks"], rec["seq_length"]).shape(BASE)
        flags = simulate_flags(shape, rec["ranks"], shape.micro_batch_size * rec["ranks"] * 2, SCHEDULES)
        preds = []
        for path in calibration_paths(rec, workdir):
            if path not in cache:
                cache[path] = _simulate(flags + ["--calibration", path, *extra])[0]
            preds.append(cache[path][rec["schedule"]])
        new = dict(rec)
        new["predicted_ms"] = statistics.mean(p["iteration_s"] for p in preds) * 1e3
        new["predicted_cpu_ms"] = [statistics.mean(p["work_s"][r] for p in preds) * 1e3 for r in range(rec["ranks"])]
        out.append(new)
    return out


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
        cpu_ratios = [statistics.mean(r["predicted_cpu_ms"]) / statistics.mean(r["measured_cpu_ms"])
                      for r in recs if r.get("measured_cpu_ms")]
        med_m = statistics.median(meas)
        out.append({
            "ranks": ranks, "seq_length": seq, "schedule": name, "rounds": len(recs),
            "measured_ms": med_m, "predicted_ms": statistics.median(pred),
            "error": statistics.median(ratios) - 1.0,
            "errors": [x - 1.0 for x in ratios],
            "cpu_error": statistics.median(cpu_ratios) - 1.0 if cpu_ratios else float("nan"),
            "measured_cpu_ms": statistics.median(statistics.mean(r["measured_cpu_ms"]) for r in recs
                                                 if r.get("measured_cpu_ms")) if cpu_ratios else float("nan"),
            "spread": (max(meas) - min(meas)) / med_m if med_m else 0.0,
            "bytes_exact": all(bytes_equal(r) for r in recs),
            "log_sent": recs[-1]["log_sent"],
            "share": statistics.median(r.get("run_cpu_share", 0.0) for r in recs),
            "calibration_share": statistics.median(r.get("calibration_share", 0.0) for r in recs),
        })
    return out
