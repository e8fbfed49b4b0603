#!/usr/bin/env python
"""GPU acceptance in one command: every check PASS, FAIL or SKIPPED (why), in one table.

    bash tools/gpu_acceptance.sh                        # exit 1 if a check FAILs
    bash tools/gpu_acceptance.sh --require-cpu-checks   # ... or a check that needs no CUDA is SKIPPED (CI)
    bash tools/gpu_acceptance.sh --json                 # stdout: one JSON object
    bash tools/gpu_acceptance.sh --json-out acc.json    # the same object in a file, beside the table

Checks that need no CUDA run on any host (here: all of them PASS); the others run where
the host has what they need (tools/acceptance/checks.py) and are SKIPPED with the reason
elsewhere. In-process checks run first; then every other group runs side by side with
the others, each on GPUs of its own (every GPU for the ring of P = N and the examples),
the longest first. Each subprocess logs under --logdir. Everything ends within
--budget-s seconds (default 570: the 10 minutes of a lent GPU, less start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

from tools.acceptance.checks import Group, Host, groups  # noqa: E402 - after the warning filter


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
    name = torch.cuda.get_device_name(0) if not reason else ""
    return Host(gpus=platform.device_count() if not reason else 0, te=platform.transformer_engine_available(),
                no_cuda_reason=reason, logdir=logdir, deadline=time.monotonic() + budget_s, gpu_name=name)


def _skipped(group: Group, why: str) -> list[dict]:
    return [dict(check=n, needs=group.needs, result="SKIPPED", reason=why, figure="", seconds=0.0) for n in group.rows]


def run_group(group: Group, host: Host, skip: set) -> list[dict]:
    """The group's rows: SKIPPED with a reason, or its results (an exception FAILs them all).
    A result ``(None, reason, s)`` is a row the group itself skips on this host."""
    why = group.skip_reason(host)
    if not why and set(group.rows) <= skip:
        why = "excluded by --skip"
    if why:
        return _skipped(group, why)
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
        result = "SKIPPED" if ok is None else ("PASS" if ok else "FAIL")
        rows.append(dict(check=n, needs=group.needs, result=result, reason=figure if ok is None else "",
                         figure="" if ok is None else figure, seconds=round(sec, 2)))
    return rows


def run_all(gs: list[Group], host: Host, skip: set, cpu_slots: int, report=lambda rows: None) -> list[list[dict]]:
    """Every group's rows, in ``gs`` order. Inline groups first, here; then the others on
    threads, each holding its GPUs (or a CPU slot): the ones needing every GPU first, then
    the longest expected; a group starts as soon as what it holds is free."""
    out: list = [None] * len(gs)
    waiting = []
    for i, g in enumerate(gs):
        why = g.skip_reason(host) or ("excluded by --skip" if set(g.rows) <= skip else "")
        if why:
            out[i] = _skipped(g, why)
        elif g.inline:
            out[i] = run_group(g, host.holding((0,)) if g.held(host) else host, skip)
            report(out[i])
        else:
            waiting.append(i)
    waiting.sort(key=lambda i: (gs[i].gpus != "all", -gs[i].expect_s, i))
    free, cpu_busy, done, running = list(range(host.gpus)), 0, queue.Queue(), {}

    def work(i, h):
        try:
            done.put((i, run_group(gs[i], h, skip)))
        except BaseException as e:  # noqa: BLE001 - a row per check whatever happens
            done.put((i, [dict(check=n, needs=gs[i].needs, result="FAIL", reason="", figure=f"{type(e).__name__}: {e}",
                               seconds=0.0) for n in gs[i].rows]))

    while waiting or running:
        for i in list(waiting):
            need = gs[i].held(host)
            if (need == 0 and cpu_busy >= cpu_slots) or need > len(free):
                continue
            waiting.remove(i)
            held, free = free[:need], free[need:]
            cpu_busy += need == 0
            running[i] = held
            threading.Thread(target=work, args=(i, host.holding(held) if need else host), daemon=True).start()
        i, rows = done.get()
        held = running.pop(i)
        free = sorted(free + held)
        cpu_busy -= gs[i].held(host) == 0
        out[i] = rows
        report(rows)
    return out


def table(rows: list[dict], host: Host, elapsed: float) -> str:
    gpu = f" ({host.gpu_name})" if host.gpu_name else ""
    lines = [f"GPU acceptance: {host.gpus} CUDA device(s){gpu}, Transformer Engine "
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
    ap.add_argument("--json-out", default=None, metavar="PATH", help="also write that JSON object to PATH")
    ap.add_argument("--skip", nargs="*", default=[], metavar="CHECK", help="checks not to run (SKIPPED)")
    ap.add_argument("--logdir", default=None, help="where each check logs (default: a new temporary folder)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="every check ends within this many seconds")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logdir = args.logdir or tempfile.mkdtemp(prefix="gpu_acceptance_")
    os.makedirs(logdir, exist_ok=True)
    t0 = time.monotonic()
    host = probe_host(logdir, args.budget_s)
    gs = groups()
    unknown = set(args.skip) - {n for g in gs for n in g.rows}
    if unknown:
        print(f"gpu_acceptance: unknown check(s) for --skip: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2

    def report(rows):
        if not args.json:
            for r in rows:
                print(f"  {r['check']}: {r['result']}", file=sys.stderr, flush=True)

    cpu_slots = max(1, (os.cpu_count() or 2) // 4)
    rows = [r for group_rows in run_all(gs, host, set(args.skip), cpu_slots, report) for r in group_rows]
    code = exit_code(rows, args.require_cpu_checks)
    elapsed = time.monotonic() - t0
    summary = dict(gpus=host.gpus, gpu_name=host.gpu_name, transformer_engine=host.te, seconds=round(elapsed, 1),
                   logdir=logdir, exit_code=code, checks=rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary) if args.json else table(rows, host, elapsed))
    return code


if __name__ == "__main__":
    sys.exit(main())
