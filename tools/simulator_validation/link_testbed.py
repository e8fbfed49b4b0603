"""Schedules side by side over an emulated link: 1F1B, interleaved, WeiPipe, FSDP2; real trainer runs.

Two ranks, each in its own network namespace (netns.py: veth pair through a bridge,
addresses 10.213.<net>.1/.2), each pinned to its own core (taskset) with one thread, the
link shaped by tc (netem: rate and one-way latency), TCP without delayed ACKs (the
routes' quickack: a 40 ms delayed-ACK stall is TCP's, not the cluster link's). A preset
scales a target cluster's compute:bandwidth ratio to this host: with h = this host's
measured single-core matmul FLOP/s and g = the GPU's effective FLOP/s (peak x EFFICIENCY),

    emulated bytes/s = link bytes/s x h / g,     emulated latency = link latency x g / h

so a step that takes the GPU t seconds of compute and the link b/B seconds takes this host
t x g/h and b/B x g/h: the ratio of compute to communication is the cluster's.

Each preset is one pair of rank processes (testbed_rank.py) that runs the trainer's
pretrain() (what pretrain_gpt.py runs) once per (sequence, round, schedule): the same
model, data (mock) and seed for every schedule, the schedules' order rotating each round so
they interleave in time. The rows are megatron_weipipe/simulator/testbed.py's
TESTBED_ROWS: the pipeline schedules at PP = 2, and FSDP2 at DP = 2 plain and under each of
its options. --microbatches takes several global batches (micro-batch 1): a pipeline rank
runs every microbatch of the batch, an FSDP2 rank half of them, so `--microbatches 2 8 32`
is 1, 4 and 16 microbatches per FSDP2 rank at the same tokens per iteration for every row;
each (sequence, batch) is a group of its own, its rounds interleaved like the others.
Sequences run in increasing order: rounds that visited every sequence in turn (so that a
row's rounds spread over the preset's minutes) made the 1K-2K runs that followed 16K-32K
runs in the same process compute 10-20% slower. Each run trains a warm-up iteration, which
is not measured, and then as many as make its tokens those of one 16K-token iteration of 4
microbatches (16 at 1K and 4 microbatches, 1 from 16K on; --iters fixes the count;
--short-warmup makes the warm-up 2 microbatches, the batch ramping to the full one after it
as Megatron's --rampup-batch-size does), so a short sequence's row is a median over as much
work as a long one's rather than over one iteration of tens of milliseconds.
Before each sequence's runs both ranks time the model's layers at that sequence on their
own cores (megatron_weipipe/training/host_calibration.py, in the rank processes, repeated for at least
--calibrate-seconds; --calibrate-repeats 0 skips it): the --save file keeps these in-run
calibrations for testbed_compare.py, since this host's speed
drifts by 10% and more between minutes.
Reported per row: tokens/s (median over rounds, [min, max]); the ratio to 1F1B (median of
the per-round ratios, [min, max]); bytes each rank sends per iteration (the trainer's byte
counter, the `sent/rank/iter` numbers); per rank, the seconds per iteration not computing
(the per-action timestamps of --schedule-trace: iteration window minus compute, i.e.
waiting on communication, bubble included) and computing; and each rank's CPU seconds
per iteration (process time: the work, whatever else shares the core).

  python -m tools.simulator_validation.link_testbed                                  # the whole sweep (docs/results/link-testbed.md)
  python -m tools.simulator_validation.link_testbed --presets ib-edr --seqs 4096 8192 16384 --rounds 3
  python -m tools.simulator_validation.link_testbed --presets ib-edr --seqs 1024 --rounds 1 --json
  python -m tools.simulator_validation.link_testbed --presets ib-edr eth25 --seqs 16384 --microbatches 8 32

Needs root, iproute2 (ip, tc with netem), util-linux (taskset, nsenter, unshare).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_weipipe.simulator.testbed import TESTBED_SCHEDULES, testbed_row
from tools.simulator_validation import netns
from tools.simulator_validation.testbed_presets import DEFAULT_PRESETS, EFFICIENCY, PRESETS, TBF_BURST_BYTES, host_flops, preset_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = TESTBED_SCHEDULES
DEFAULT_SEQS = (1024, 2048, 4096, 8192, 16384)
LONG = {"ib-edr": (32768,)}  # 32K only at ib-edr
NOTES: set[str] = set()


MEASURED_TOKENS = 4 * 16384  # per run: the tokens of one 16K iteration of 4 microbatches
WARMUP_MICROBATCHES = 2  # --short-warmup's first iteration: one microbatch per FSDP2 rank


def iterations(seq: int, microbatches: int, a) -> int:
    """Iterations per run: --iters, or a warm-up and MEASURED_TOKENS // (seq x microbatches)
    (at least 1) measured."""
    return a.iters if a.iters else 1 + max(1, MEASURED_TOKENS // (seq * microbatches))


def length_argv(seq: int, microbatches: int, a) -> list[str]:
    """The run's length: `iterations`, or with --short-warmup a warm-up iteration of
    WARMUP_MICROBATCHES and then the measured iterations at the full batch (Megatron's
    --rampup-batch-size, which counts samples)."""
    n = iterations(seq, microbatches, a)
    if not getattr(a, "short_warmup", False) or microbatches <= WARMUP_MICROBATCHES:
        return ["--train-iters", str(n)]
    return ["--train-samples", str(WARMUP_MICROBATCHES + microbatches * (n - 1)), "--rampup-batch-size",
            str(WARMUP_MICROBATCHES), str(microbatches - WARMUP_MICROBATCHES), str(WARMUP_MICROBATCHES)]


def model_argv(seq: int, microbatches: int, a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--position-embedding-type", "rope",
            "--micro-batch-size", "1", "--global-batch-size", str(microbatches), *length_argv(seq, microbatches, a),
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
            "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "128", "--eval-iters", "0",
            "--log-interval", "1", "--seed", "1234", "--distributed-backend", "gloo",
            "--untie-embeddings-and-output-weights"]  # one model for every row (FSDP needs it untied)


def runnable(seq: int, microbatches: int, a) -> dict[str, str | None]:
    """Schedule -> None if the trainer accepts its command line, else the one-line reason."""
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.errors import ConfigError

    out = {}
    for name in a.schedules:
        row = testbed_row(name)
        if row.virtual_stages and (a.layers % 4 or a.layers < 4):
            out[name] = f"needs --layers a multiple of 4 (2 ranks x 2 virtual stages), not {a.layers}"
            continue
        try:
            parse_config(model_argv(seq, microbatches, a) + row.trainer_flags(a.layers), world_size=2)
            out[name] = None
        except (ConfigError, SystemExit) as e:
            out[name] = f"the trainer refuses it here: {e}"
    return out


def run_preset(preset: str, seqs, a, flops: float, work: str) -> tuple[list[dict], dict]:
    """All (seq, microbatches, round, schedule) runs of one preset in one pair of rank
    processes: the rows, and {seq: [each rank's in-run calibration]}."""
    p = PRESETS[preset]
    rate_bps, latency_s = p.emulated(flops)
    jobs, skipped = [], {}
    for seq in seqs:  # sequence by sequence: a short run after long ones computes 10-20% slower here
        if a.calibrate_repeats:
            jobs.append({"key": [seq, 0, -1, "calibration"], "calibrate": {
                "seq": seq, "layers": a.layers, "hidden": a.hidden, "heads": a.heads, "repeats": a.calibrate_repeats,
                "min_seconds": a.calibrate_seconds}})
        for mb in a.microbatches:
            ok = runnable(seq, mb, a)
            skipped[seq, mb] = {n: why for n, why in ok.items() if why}
            names = [n for n in a.schedules if not ok[n]]
            for r in range(a.rounds):
                for n in names[r % len(names):] + names[:r % len(names)]:
                    trace = os.path.join(work, f"{preset}-{seq}-{mb}-{r}-{n}")
                    jobs.append({"key": [seq, mb, r, n], "trace": trace, "argv": model_argv(seq, mb, a)
                                 + testbed_row(n).trainer_flags(a.layers) + ["--schedule-trace", trace]})
    jobs_path = os.path.join(work, f"{preset}-jobs.json")
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)
    netns.remove_stale()
    with netns.Testbed(2) as tb:
        for i in (0, 1):  # both ends of each veth: one-way latency = 2 x delay
            try:
                tb.shape(i, rate=f"{int(rate_bps * 8)}bit", delay_ms=latency_s * 1e3 / 2)
            except RuntimeError as e:  # no netem in this kernel: the rate alone (tbf), said in the output
                if "netem" not in str(e):
                    raise
                tb.shape(i, rate=f"{int(rate_bps * 8)}bit", burst=f"{TBF_BURST_BYTES}b", queue_ms=2000)
                NOTES.add("tc netem is not available in this kernel: the emulated latency is not applied, "
                          f"the rate alone is (tc tbf, {TBF_BURST_BYTES // 1024} KiB burst, 2 s queue)")
            tb.quick_ack(i)  # an interconnect has no delayed ACK (netns.py)
        cores = sorted(os.sched_getaffinity(0))
        outs = [os.path.join(work, f"{preset}-rank{i}.json") for i in (0, 1)]
        logs = [open(os.path.join(work, f"{preset}-rank{i}.log"), "w") for i in (0, 1)]
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=tb.addr(0),
                   MASTER_PORT="29500", GLOO_SOCKET_IFNAME="eth0", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore",
                   # the rank watchdog's heartbeats would share the shaped link: a heartbeat queued
                   # behind seconds of tensors (or retransmitted after a tbf drop) reads as a lost peer
                   MEGATRON_WEIPIPE_WATCHDOG="0")
        core = [str(cores[i % len(cores)]) for i in (0, 1)]
        pin = [["taskset", "-c", c] if shutil.which("taskset") else [] for c in core]  # else the rank pins itself
        procs = [tb.popen(i, [*pin[i], sys.executable, "-m", "tools.simulator_validation.testbed_rank", jobs_path,
                              outs[i]], env=dict(env, RANK=str(i), TESTBED_CORE=core[i]), stdout=logs[i],
                          stderr=subprocess.STDOUT) for i in (0, 1)]
        deadline = time.monotonic() + a.timeout
        while any(q.poll() is None for q in procs):
            if time.monotonic() > deadline or any(q.poll() not in (None, 0) for q in procs):
                break
            time.sleep(0.5)
        codes = [q.poll() for q in procs]
        for f in logs:
            f.close()
        if codes != [0, 0]:
            tails = [open(f.name).read()[-2500:] for f in logs]
            why = f"timed out after {a.timeout:.0f}s" if all(c in (None, 0) for c in codes) else f"exit codes {codes}"
            raise RuntimeError(f"{preset}: rank processes {why}\n--- rank 0\n{tails[0]}\n--- rank 1\n{tails[1]}")
    per_rank = [{tuple(r["key"]): r for r in json.load(open(o))} for o in outs]
    cals = {seq: [rk[(seq, 0, -1, "calibration")]["calibration"] for rk in per_rank]
            for seq in seqs if (seq, 0, -1, "calibration") in per_rank[0]}
    return collect(preset, seqs, a, [j for j in jobs if "argv" in j], per_rank, skipped), cals


def collect(preset, seqs, a, jobs, per_rank, skipped) -> list[dict]:
    from megatron_weipipe.schedules.timing import measured

    runs = {}  # (seq, microbatches, name) -> list over rounds of measures
    for job in jobs:
        seq, mb, r, n = job["key"]
        its = [rk[(seq, mb, r, n)]["iterations"][1:] for rk in per_rank]  # the first is the warm-up
        iter_s = statistics.median(max(x["elapsed_ms"] for x in pair) / 1e3 for pair in zip(*its))
        sent = [rk[-1]["bytes_sent"] for rk in its]
        cpu_s = [statistics.median(x.get("cpu_s", 0.0) for x in rk) for rk in its]
        m = measured.measure(measured.load(job["trace"]))
        k = len(m.iterations)
        runs.setdefault((seq, mb, n), []).append({
            "round": r, "iter_s": iter_s, "tokens_per_s": mb * seq / iter_s,
            "bytes_by_kind": {kind: statistics.mean(s.get(kind, 0) for s in sent)
                              for kind in sorted({kk for s in sent for kk in s})},
            "idle_s": [x.idle_s / k for x in m.ranks], "busy_s": [x.busy_s / k for x in m.ranks],
            "recv_wait_s": [(x.wait_s + x.send_s) / k for x in m.ranks], "cost_s": m.mean_cost_s, "cpu_s": cpu_s})
    rows = []
    for seq, mb in ((seq, mb) for seq in seqs for mb in a.microbatches):
        base = {x["round"]: x["iter_s"] for x in runs.get((seq, mb, "1f1b"), [])}
        for n in a.schedules:
            if n in skipped[seq, mb]:
                rows.append({"preset": preset, "seq": seq, "microbatches": mb, "schedule": n, "tokens_per_s": None,
                             "bytes_sent": None, "skipped": skipped[seq, mb][n]})
                continue
            rs = runs[(seq, mb, n)]
            tps = [x["tokens_per_s"] for x in rs]
            ratios = [base[x["round"]] / x["iter_s"] for x in rs if x["round"] in base]
            rows.append({
                "preset": preset, "seq": seq, "microbatches": mb, "schedule": n, "tokens_per_s": statistics.median(tps),
                "tokens_per_s_rounds": tps, "ratio_to_1f1b": statistics.median(ratios) if ratios else None,
                "ratio_rounds": ratios, "bytes_sent": sum(rs[-1]["bytes_by_kind"].values()),
                "bytes_by_kind": rs[-1]["bytes_by_kind"],
                "idle_s_per_rank": [statistics.median(x["idle_s"][i] for x in rs) for i in (0, 1)],
                "busy_s_per_rank": [statistics.median(x["busy_s"][i] for x in rs) for i in (0, 1)],
                "recv_wait_s_per_rank": [statistics.median(x["recv_wait_s"][i] for x in rs) for i in (0, 1)],
                "iter_s": statistics.median(x["iter_s"] for x in rs),
                "cpu_s_per_rank": [statistics.median(x["cpu_s"][i] for x in rs) for i in (0, 1)],
                # per round: mean seconds of one compute action by kind (one layer, one microbatch)
                "compute_action_s_rounds": [x["cost_s"] for x in rs]})
    return rows


def _span(xs, fmt):
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))}, {fmt(max(xs))}]" if xs else "-"


def table(rows: list[dict]) -> str:
    lines = ["| preset | seq | schedule | tokens/s median [min, max] | x 1F1B median [min, max] | MiB sent/rank/iter "
             "(by kind) | not computing s/iter rank 0 / 1 | computing s/iter rank 0 / 1 | CPU s/iter rank 0 / 1 |",
             "|" + "---|" * 9]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['preset']} | {r['seq']} | {r['schedule']} | skipped: {r['skipped']} ||||||")
            continue
        kinds = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["bytes_by_kind"].items() if v)
        lines.append(
            f"| {r['preset']} | {r['seq']} | {r['schedule']} | {_span(r['tokens_per_s_rounds'], lambda v: f'{v:.0f}')} "
            f"| {_span(r['ratio_rounds'], lambda v: f'{v:.2f}')} | {r['bytes_sent'] / 2**20:.2f} ({kinds}) "
            f"| {r['idle_s_per_rank'][0]:.2f} / {r['idle_s_per_rank'][1]:.2f} "
            f"| {r['busy_s_per_rank'][0]:.2f} / {r['busy_s_per_rank'][1]:.2f} "
            f"| {r['cpu_s_per_rank'][0]:.2f} / {r['cpu_s_per_rank'][1]:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=list(PRESETS))
    ap.add_argument("--seqs", type=int, nargs="+", default=None,
                    help="sequence lengths (default: 1K..16K at every preset, and 32K at ib-edr)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; every schedule runs once per round")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the tables")
    ap.add_argument("--save", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--layers", type=int, default=2, help="4 or more (a multiple of 4) adds the interleaved row")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4],
                    help="per iteration (global batch; micro-batch 1), one group of rows per value: an FSDP2 rank "
                         "runs half of them, a pipeline rank all")
    ap.add_argument("--iters", type=int, default=None,
                    help="iterations per run, the first not measured (default: a warm-up, then 16K tokens' worth: "
                         "16 at 1K, 1 from 16K on)")
    ap.add_argument("--short-warmup", action="store_true",
                    help=f"the warm-up iteration runs {WARMUP_MICROBATCHES} microbatches, the measured ones the full "
                         "batch (--rampup-batch-size): a large batch's run costs one iteration less")
    ap.add_argument("--calibrate-repeats", type=int, default=2,
                    help="repeats of the in-run calibration before each sequence's runs (0: none)")
    ap.add_argument("--calibrate-seconds", type=float, default=2.0,
                    help="more repeats of it while they took less than this (a short sequence's timings are "
                         "milliseconds each)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per preset")
    ap.add_argument("--flops", type=float, default=None, help="host FLOP/s (default: measured at start-up)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.calibrate_repeats < 0 or a.calibrate_seconds < 0 or a.rounds < 1 or min(a.microbatches) < 2:
        print("error: --rounds >= 1, --microbatches >= 2 (the FSDP2 rows run half on each rank), "
              "--calibrate-repeats >= 0 and --calibrate-seconds >= 0", file=sys.stderr)
        return 2
    reason = netns.available()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the testbed's `with` cleans up
    t0, load0 = time.time(), os.getloadavg()[0]
    flops = a.flops or host_flops()
    print(preset_table(flops, a.presets), file=sys.stderr, flush=True)  # kept if the run is cut short
    rows, cals = [], {}
    with tempfile.TemporaryDirectory(prefix="link_testbed") as work:
        for preset in a.presets:
            seqs = a.seqs or list(DEFAULT_SEQS) + list(LONG.get(preset, ()))
            got, cals[preset] = run_preset(preset, seqs, a, flops, work)
            rows += got
            print(f"# {preset} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "flops": flops, "notes": sorted(NOTES),
                       "rows": rows, "calibrations": cals}, f, indent=1)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("# command: python -m tools.simulator_validation.link_testbed " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; wall {time.time() - t0:.0f}s; host load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end")
    print(preset_table(flops, a.presets))
    for note in sorted(NOTES):
        print(f"note: {note}")
    for mb in a.microbatches:  # one table per batch, its shape line first (tools/planner/testbed_check.py reads it)
        print(f"\n2 ranks, 1 core and 1 thread each; layers={a.layers} hidden={a.hidden} heads={a.heads} "
              f"micro-batch 1, {mb} microbatches/iteration ({mb // 2} per FSDP2 rank), "
              f"{f'{a.iters} iterations' if a.iters else 'a warm-up + ' + str(MEASURED_TOKENS) + ' // (seq x microbatches) iterations'} "
              f"per run (first not measured{f', of {WARMUP_MICROBATCHES} microbatches' if a.short_warmup and mb > WARMUP_MICROBATCHES else ''}), {a.rounds} rounds; float32, rope, no dropout, mock data, seed 1234\n")
        print(table([r for r in rows if r["microbatches"] == mb]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
