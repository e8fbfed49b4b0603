#!/usr/bin/env python
"""GPU acceptance in one command: every check PASS, FAIL or SKIPPED (why), in one table.

    bash tools/gpu_acceptance.sh                        # exit 1 if a check FAILs
    bash tools/gpu_acceptance.sh --require-cpu-checks   # ... or a check that needs no CUDA is SKIPPED (CI)
    bash tools/gpu_acceptance.sh --json                 # stdout: one JSON object

Checks that need no CUDA run on any host (here: all of them PASS); the others run where
the host has what they need (tools/acceptance/checks.py) and are SKIPPED with the reason
elsewhere. Each subprocess logs to --logdir/<check>.log. Everything ends within
--budget-s seconds (default 570: the 10 minutes of a lent GPU, less start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
warnings.filterwarnings("ignore")

from acceptance.checks import Group, Host, groups  # noqa: E402


def probe_host(logdir: str, budget_s: float) -> Host:
    import torch

    from megatron_weipipe.platform import detect_platform

    platform = detect_platform()
    if torch.version.cuda is None:
        reason = f"no CUDA: torch {torch.__version__} is a CPU-only build"
    elif not platform.is_cuda:
        reason = "no CUDA device visible (or MEGATRON_WEIPIPE_FORCE_CPU=1)"
    else:
        reason = ""
    return Host(gpus=platform.device_count(), te=platform.transformer_engine_available(), no_cuda_reason=reason,
                logdir=logdir, deadline=time.monotonic() + budget_s)


def run_group(group: Group, host: Host, skip: set) -> list[dict]:
    """The group's rows: SKIPPED with a reason, or its results (an exception FAILs them all)."""
    why = group.skip_reason(host)
    if not why and set(group.rows) <= skip:
        why = "excluded by --skip"
    if why:
        return [dict(check=n, needs=group.needs, result="SKIPPED", reason=why, figure="", seconds=0.0)
                for n in group.rows]
    t0 = time.perf_counter()
    try:
        results = group.run(host)
    except Exception as e:  # one line in the table, the traceback in the log
        with open(os.path.join(host.logdir, f"{group.rows[0]}.error.log"), "w") as f:
            f.write(traceback.format_exc())
        line = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        results = {n: (False, line, time.perf_counter() - t0) for n in group.rows}
    rows = []
    for n in group.rows:
        ok, figure, sec = results.get(n, (False, "no result", time.perf_counter() - t0))
        rows.append(dict(check=n, needs=group.needs, result="PASS" if ok else "FAIL", reason="", figure=figure,
                         seconds=round(sec, 2)))
    return rows


def table(rows: list[dict], host: Host, elapsed: float) -> str:
    lines = [f"GPU acceptance: {host.gpus} CUDA device(s), Transformer Engine "
             f"{'installed' if host.te else 'absent'}; {elapsed:.0f} s; logs in {host.logdir}",
             "| check | needs | result | figure | time |", "|---|---|---|---|---|"]
    for r in rows:
        result = f"SKIPPED ({r['reason']})" if r["result"] == "SKIPPED" else r["result"]
        t = f"{r['seconds']:.1f} s" if r["result"] != "SKIPPED" else ""
        lines.append(f"| {r['check']} | {r['needs']} | {result} | {r['figure'].replace('|', '/')} | {t} |")
    return "\n".join(lines)


def exit_code(rows: list[dict], require_cpu_checks: bool) -> int:
    if any(r["result"] == "FAIL" for r in rows):
        return 1
    if require_cpu_checks and any(r["needs"] == "cpu" and r["result"] != "PASS" for r in rows):
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--require-cpu-checks", action="store_true",
                    help="also fail when a check that needs no CUDA is SKIPPED (CI)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--skip", nargs="*", default=[], metavar="CHECK", help="checks not to run (SKIPPED)")
    ap.add_argument("--logdir", default=None, help="where each check logs (default: a new temporary folder)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="every check ends within this many seconds")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logdir = args.logdir or tempfile.mkdtemp(prefix="gpu_acceptance_")
    os.makedirs(logdir, exist_ok=True)
    t0 = time.monotonic()
    host = probe_host(logdir, args.budget_s)
    known = {n for g in groups() for n in g.rows}
    unknown = set(args.skip) - known
    if unknown:
        print(f"gpu_acceptance: unknown check(s) for --skip: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    rows = []
    for group in groups():
        rows += run_group(group, host, set(args.skip))
        if not args.json:
            for r in rows[-len(group.rows):]:
                print(f"  {r['check']}: {r['result']}", file=sys.stderr, flush=True)
    code = exit_code(rows, args.require_cpu_checks)
    elapsed = time.monotonic() - t0
    if args.json:
        print(json.dumps(dict(gpus=host.gpus, transformer_engine=host.te, seconds=round(elapsed, 1),
                              logdir=logdir, exit_code=code, checks=rows)))
    else:
        print(table(rows, host, elapsed))
    return code


if __name__ == "__main__":
    sys.exit(main())
