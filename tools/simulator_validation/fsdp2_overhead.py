"""FSDP2's fixed cost per unit and pass on this host: the testbed's FSDP row against plain DDP;
and the training loop's own cost per iteration.

    python -m tools.simulator_validation.fsdp2_overhead [--seq 512] [--rounds 2] [--layers 2 --hidden 32 --heads 2]
        [--row fsdp-sync-once]    # the fixed costs under one of FSDP2's options (a testbed row)

Two ranks on loopback (no namespaces, no shaping), each pinned to its own core with one
thread, run the link testbed's model (link_testbed.py's command line) as PP = 1,
DP = 2 twice per round: with ``--use-torch-fsdp2`` and with megatron-core's DDP, in one
pair of processes (testbed_rank.py), alternating. The same model, data and seed
compute the same FLOPs in both; what FSDP2 adds to a microbatch's forward and backward
(the per-action timestamps of ``--schedule-trace``) is its fixed cost: the units' hooks,
the DTensor bookkeeping, the copies in and out of the gathered buffers, and each
collective's own cost over gloo (its bytes take microseconds on loopback at this size).
Divided by the units (embedding, each layer, the root), it is the per-unit cost that
testbed_compare.py adds to its FSDP rows (each round's too:
the spread of its predictions); the link's time for the collectives' bytes is the
simulator's own. The DDP runs also give the training loop's
own time per iteration, which every schedule pays: from one iteration's end to the next
one's start, less the optimizer step (reading the microbatches, zeroing the gradients,
the per-iteration flag all-reduce, logging). testbed_compare.py adds it to the
point-to-point rows; FSDP's step besides its microbatches holds it already. A
microbenchmark of its own: no testbed row is read. Prints a table and, with --json, the
numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_weipipe.simulator.testbed import TESTBED_ROWS, testbed_row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DDP_ARGV = ["--pipeline-model-parallel-size", "1"]


FSDP_ROWS = tuple(n for n, row in TESTBED_ROWS.items() if row.is_fsdp)  # the testbed's FSDP2 rows


def units(layers: int) -> int:
    """FSDP units of the trainer's model: the embedding, each layer, the root (link_testbed.py's
    model is untied: the root holds the final norm and the output layer)."""
    return layers + 2


def measure(a) -> dict:
    """Per round, the mean forward and backward seconds of one microbatch under FSDP2 and DDP."""
    from megatron_weipipe.schedules.timing import measured
    from tools.simulator_validation import netns
    from tools.simulator_validation.link_testbed import model_argv

    with tempfile.TemporaryDirectory(prefix="fsdp2_overhead") as work:
        jobs, fsdp_argv = [], testbed_row(a.row).trainer_flags(a.layers)
        for r in range(a.rounds):
            for name, extra in (("fsdp", fsdp_argv), ("ddp", DDP_ARGV))[::1 if r % 2 == 0 else -1]:
                trace = os.path.join(work, f"{name}-{r}")
                jobs.append({"key": [r, name], "trace": trace,
                             "argv": model_argv(a.seq, a.microbatches, a) + extra + ["--schedule-trace", trace]})
        jobs_path = os.path.join(work, "jobs.json")
        with open(jobs_path, "w") as f:
            json.dump(jobs, f)
        cores = sorted(os.sched_getaffinity(0))
        port = str(20000 + os.getpid() % 20000)
        stack = contextlib.ExitStack()
        tb = stack.enter_context(netns.Testbed(2)) if a.netns else None
        for i in (0, 1) if tb else ():
            tb.quick_ack(i)  # as the link testbed runs
        procs = []
        for i in (0, 1):
            env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK=str(i), LOCAL_RANK="0",
                       MASTER_ADDR=tb.addr(0) if tb else "127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT,
                       PYTHONWARNINGS="ignore", TESTBED_CORE=str(cores[i % len(cores)]),
                       MEGATRON_WEIPIPE_WATCHDOG="0", **({"GLOO_SOCKET_IFNAME": "eth0"} if tb else {}))
            log = open(os.path.join(work, f"rank{i}.log"), "w")
            argv = [sys.executable, "-m", "tools.simulator_validation.testbed_rank", jobs_path,
                    os.path.join(work, f"rank{i}.json")]
            p = tb.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT) if tb else \
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append((p, log))
        deadline = time.monotonic() + a.timeout
        try:
            while any(p.poll() is None for p, _ in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
                    break
                time.sleep(0.5)
        finally:
            for p, log in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                log.close()
            stack.close()
        if [p.returncode for p, _ in procs] != [0, 0]:
            tail = open(os.path.join(work, "rank0.log")).read()[-2000:]
            raise RuntimeError(f"rank processes failed or timed out ({[p.returncode for p, _ in procs]}):\n{tail}")
        per_rank = [{tuple(r["key"]): r for r in json.load(open(os.path.join(work, f"rank{i}.json")))}
                    for i in (0, 1)]
        out = {"fsdp": [], "ddp": []}
        for job in jobs:
            r, name = job["key"]
            traces = measured.load(job["trace"])
            cost = measured.measure(traces).mean_cost_s
            its = [rk[(r, name)]["iterations"][1:] for rk in per_rank]  # the first is the warm-up
            iter_s = statistics.median(max(x["elapsed_ms"] for x in pair) / 1e3 for pair in zip(*its))
            loop = measured.between_iterations_s(traces)
            out[name].append({"forward": cost["forward"], "backward": cost["backward"], "iteration": iter_s,
                              "loop": statistics.mean(loop) if loop else float("nan")})
    return out


def overhead(runs: dict, layers: int, microbatches_per_rank: int) -> dict:
    """FSDP2's seconds per unit and pass (the medians over rounds of FSDP minus DDP), its
    iteration's seconds besides its microbatches, the same three of each round, and the
    training loop's own seconds per iteration (the DDP runs: outside the schedule and the
    optimizer step)."""
    n = units(layers)
    res = {}
    for kind in ("forward", "backward", "iteration"):
        f = statistics.median(x[kind] for x in runs["fsdp"])
        d = statistics.median(x[kind] for x in runs["ddp"])
        res[kind] = {"fsdp_s": f, "ddp_s": d, "per_unit_s": max(0.0, f - d) / n}

    def step(x):
        return x["iteration"] - microbatches_per_rank * (x["forward"] + x["backward"])

    res["step_s"] = statistics.median(step(x) for x in runs["fsdp"])
    res["loop_s"] = statistics.median(x["loop"] for x in runs["ddp"])
    # each round's FSDP run against the DDP run beside it: the probe's own spread
    res["by_round"] = [[max(0.0, f[kind] - d[kind]) / n for kind in ("forward", "backward")] + [step(f)]
                     for f, d in zip(runs["fsdp"], runs["ddp"])]
    return res


def fsdp2_overhead(a):
    """The Fsdp2Overhead this host measures for the command line ``a`` (parse_args)."""
    from megatron_weipipe.simulator.calibration import Fsdp2Overhead

    res = overhead(measure(a), a.layers, a.microbatches // 2)
    return Fsdp2Overhead(res["forward"]["per_unit_s"], res["backward"]["per_unit_s"], res["step_s"],
                         tuple(map(tuple, res["by_round"]))), res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512, help="a short sequence: the compute the two share stays small")
    ap.add_argument("--rounds", type=int, default=2, help="FSDP and DDP runs each, alternating")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8, help="per iteration: 4 per rank")
    ap.add_argument("--iters", type=int, default=6, help="iterations per run; the first is not measured")
    ap.add_argument("--row", default="fsdp", choices=FSDP_ROWS,
                    help="the testbed's FSDP2 row to probe: plain, or under FSDP2's options")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--netns", action="store_true",
                    help="each rank in its own network namespace over an unshaped veth pair, as the testbed runs "
                         "(needs root), instead of loopback")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.rounds < 1 or a.seq < 1:
        print("error: --rounds and --seq must be positive", file=sys.stderr)
        return 2
    t0 = time.time()
    _, res = fsdp2_overhead(a)
    res.update(units=units(a.layers), seq=a.seq, layers=a.layers, hidden=a.hidden, heads=a.heads, rounds=a.rounds)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"# command: python -m tools.simulator_validation.fsdp2_overhead {' '.join(sys.argv[1:] if argv is None else argv)}")
    where = "over a veth pair" if a.netns else "on loopback"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; wall {time.time() - t0:.0f}s; 2 ranks {where}, 1 core and 1 "
          f"thread each; layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq}; {res['units']} FSDP units; "
          f"row {a.row}")
    print("| pass | FSDP2 s/microbatch | DDP s/microbatch | FSDP2 - DDP | per unit |")
    print("|---|---|---|---|---|")
    for kind in ("forward", "backward"):
        r = res[kind]
        print(f"| {kind} | {r['fsdp_s'] * 1e3:.2f} ms | {r['ddp_s'] * 1e3:.2f} ms | "
              f"{(r['fsdp_s'] - r['ddp_s']) * 1e3:.2f} ms | {r['per_unit_s'] * 1e3:.2f} ms |")
    r = res["iteration"]
    print(f"| iteration ({a.microbatches // 2} microbatches per rank) | {r['fsdp_s'] * 1e3:.2f} ms | "
          f"{r['ddp_s'] * 1e3:.2f} ms | {(r['fsdp_s'] - r['ddp_s']) * 1e3:.2f} ms | |")
    per_round = list(zip(*res["by_round"]))
    print(f"\nper unit, over the {a.rounds} rounds (each FSDP2 run against the DDP run beside it): forward "
          f"{min(per_round[0]) * 1e3:.2f} to {max(per_round[0]) * 1e3:.2f} ms, backward {min(per_round[1]) * 1e3:.2f} "
          f"to {max(per_round[1]) * 1e3:.2f} ms")
    print(f"FSDP2's step besides its microbatches (iteration - microbatches x (forward + backward)): "
          f"{res['step_s'] * 1e3:.2f} ms")
    print(f"the training loop's own time per iteration (DDP: between iterations, besides the optimizer step): "
          f"{res['loop_s'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
