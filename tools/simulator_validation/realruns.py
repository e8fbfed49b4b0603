"""Launch real pretrain_gpt.py runs under torchrun (through probe_run.py) and read back what they logged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from megatron_weipipe.shape import ModelShape

from tools.simulator_validation.probe_run import ENV, REPO

_ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+).*?"
                      r"(?:sent/rank/iter: (.*?) \|)?\s*$")


@dataclass
class RealRun:
    schedule: str
    ranks: int
    seq_length: int
    elapsed_ms: float  # the log line of the last window
    log_sent: str  # the log line's sent/rank/iter field (rank 0)
    sent: dict = field(default_factory=dict)  # rank -> kind -> exact bytes, last logged iteration
    cpu_share: float = 0.0  # CPU seconds per wall second per rank over the last window (mean of ranks)
    cpu_ms: tuple = ()  # per rank: CPU milliseconds per iteration over the last window
    wall_s: float = 0.0
    command: str = ""


def pretrain_flags(shape: ModelShape, ranks: int, schedule: str, global_batch_size: int,
                   train_iters: int, log_interval: int) -> list[str]:
    """pretrain_gpt.py flags for a CPU timing run of this shape (fp32, dropout off, mock data)."""
    flags = [
        "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
        "--num-attention-heads", str(shape.num_attention_heads), "--seq-length", str(shape.seq_length),
        "--micro-batch-size", str(shape.micro_batch_size), "--global-batch-size", str(global_batch_size),
        "--pipeline-model-parallel-size", str(ranks), "--pipeline-schedule", schedule,
        "--train-iters", str(train_iters), "--log-interval", str(log_interval), "--eval-iters", "0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.vocab_size - 1),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
    ]
    return flags


def launch(ranks: int, flags: list[str], probe_dir: str, *, timeout: float = 900.0) -> tuple[str, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "tools.simulator_validation.probe_run", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[ENV] = probe_dir
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"run failed ({proc.returncode}): " + " | ".join(tail))
    shown = "torchrun --nproc-per-node {} pretrain_gpt.py {}".format(ranks, " ".join(flags))
    return proc.stdout, wall, shown


def _probe_records(probe_dir: str) -> tuple[dict, float, tuple]:
    """rank -> bytes sent by kind in the last logged iteration; the ranks' mean CPU share
    (CPU seconds per wall second) and per-rank CPU ms per iteration over the last window."""
    sent, shares, cpu = {}, [], {}
    for name in sorted(os.listdir(probe_dir)):
        with open(os.path.join(probe_dir, name)) as f:
            recs = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["iteration"])
        last = recs[-1]
        sent[last["rank"]] = last["sent"]
        if len(recs) > 1:
            prev = recs[-2]
            shares.append((last["cpu_s"] - prev["cpu_s"]) / max(last["wall_s"] - prev["wall_s"], 1e-9))
            cpu[last["rank"]] = (last["cpu_s"] - prev["cpu_s"]) * 1e3 / (last["iteration"] - prev["iteration"])
    return sent, (sum(shares) / len(shares) if shares else 0.0), tuple(cpu[r] for r in sorted(cpu))


def parse(stdout: str, schedule: str, ranks: int, seq_length: int, sent: dict) -> RealRun:
    elapsed, log_sent = None, ""
    for line in stdout.splitlines():
        m = _ELAPSED.search(line)
        if m:
            elapsed = float(m.group(2))
            log_sent = (m.group(3) or "").strip()
    if elapsed is None:
        raise RuntimeError("no iteration log line in the run's output")
    return RealRun(schedule, ranks, seq_length, elapsed, log_sent, sent)


def real_run(shape: ModelShape, ranks: int, schedule: str, global_batch_size: int, *,
             train_iters: int = 4, log_interval: int = 2) -> RealRun:
    flags = pretrain_flags(shape, ranks, schedule, global_batch_size, train_iters, log_interval)
    with tempfile.TemporaryDirectory() as d:
        out, wall, shown = launch(ranks, flags, d)
        sent, share, cpu = _probe_records(d)
    run = parse(out, schedule, ranks, shape.seq_length, sent)
    run.wall_s, run.command, run.cpu_share, run.cpu_ms = wall, shown, share, cpu
    return run
