"""Run a parity batch (tools/acceptance/parity_runs.py) and turn its runs into rows.

Each run is isolated: one that raises, crashes its torchrun or hangs past its timeout is
one FAIL row with its first error line, and a new torchrun carries on with the runs after
it (``run_batch``). Only the acceptance budget (``--budget-s``) stops a batch early; the
runs it leaves say so.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

from tools.acceptance.parity_runs import Batch, Run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = "tools.acceptance.parity_worker"  # a module: torchrun -m, from ROOT
CPU_ENV = {"MEGATRON_WEIPIPE_FORCE_CPU": "1"}
START_TIMEOUT_S = 240.0  # launch to the first run's start line (imports, process start-up)
RUN_TIMEOUT_ENV = "GPU_ACCEPTANCE_RUN_TIMEOUT_S"  # caps every run's timeout (tests use a short one)
POLL_S = 0.25


def _run_timeout(run: Run) -> float:
    cap = os.environ.get(RUN_TIMEOUT_ENV)
    return min(run.timeout_s, float(cap)) if cap else run.timeout_s


class _Progress:
    """What the worker's JSON lines say so far (every rank appends to one file)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0
        self.started: list = []  # run names, in start order
        self.started_at: dict = {}
        self.results: dict = {}  # name -> {rank: record}
        self.errors: dict = {}  # name -> [records]

    def read(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        lines = chunk.split("\n")
        self.offset += len(chunk) - len(lines[-1])  # an unfinished last line is read next time
        for line in lines[:-1]:
            if not line.strip():
                continue
            rec = json.loads(line)
            name = rec["name"]
            if rec["event"] == "start":
                self.started.append(name)
                self.started_at[name] = time.monotonic()
            elif rec["event"] == "result":
                self.results.setdefault(name, {})[rec["rank"]] = rec
            else:
                self.errors.setdefault(name, []).append(rec)


def _last_line(log: str) -> str:
    try:
        lines = [ln.strip() for ln in open(log, errors="replace") if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return ((errors or lines or ["no output"])[-1])[:200]


def _first_error(records: list) -> str:
    """The failing rank's own line before a peer's 'stopping: rank N failed' echo of it."""
    own = [r for r in records if not r["error"].startswith("stopping:")]
    return (own or records)[0]["error"]


def _launch(host, batch: Batch, spec: str, out: str, names: list, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(batch.world),
           "-m", WORKER, "--spec", spec, "--out", out, *names]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(CPU_ENV if batch.backend == "gloo" else {}), **batch.env,
           **host.device_env()}
    f = open(log, "a")
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    f.close()
    return proc


def stop_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``proc`` and every process it started. torchrun starts each rank in a session
    of its own, so killing torchrun's session would leave a hung rank (and its GPU)
    behind: its descendants are listed first, torchrun is asked to stop them (SIGTERM),
    and whatever is left after ``grace_s`` is killed by pid."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for p in [*tree]:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_batch(host, batch: Batch) -> dict:
    """{run name: merged result, or {"error": line}} for every run of ``batch``."""
    spec = os.path.join(host.logdir, f"{batch.name}.spec.json")
    out = os.path.join(host.logdir, f"{batch.name}.jsonl")
    log = os.path.join(host.logdir, f"{batch.name}.log")
    for path in (out, log):
        if os.path.exists(path):
            os.remove(path)
    with open(spec, "w") as f:
        json.dump({"runs": [r.spec() for r in batch.runs]}, f)
    by_name = {r.name: r for r in batch.runs}
    progress, outcome = _Progress(out), {}
    pending = [r.name for r in batch.runs]
    while pending:
        if host.deadline - time.monotonic() < 5:
            outcome.update({n: {"error": "not run: the acceptance budget (--budget-s) ran out"} for n in pending})
            break
        before = len(progress.started)
        proc = _launch(host, batch, spec, out, pending, log)
        launched, cut = time.monotonic(), None
        while proc.poll() is None:
            time.sleep(POLL_S)
            progress.read()
            now = time.monotonic()
            current = progress.started[-1] if len(progress.started) > before else None
            if current is None and now - launched > min(START_TIMEOUT_S, host.left(START_TIMEOUT_S)):
                cut = f"no run started within {now - launched:.0f} s of the launch"
            elif current is not None and now - progress.started_at[current] > _run_timeout(by_name[current]):
                cut = f"no result within {now - progress.started_at[current]:.0f} s: a hang (timeout)"
            elif host.deadline - now < 1:
                cut = "cut by the acceptance budget (--budget-s)"
            if cut:
                stop_tree(proc)
                break
        time.sleep(POLL_S)  # lines written just before the exit
        progress.read()
        started = progress.started[before:]
        for name in started:
            if name in progress.errors:
                outcome[name] = {"error": _first_error(progress.errors[name])}
            elif len(progress.results.get(name, {})) == batch.world:
                outcome[name] = _merge(progress.results[name])
            else:
                why = cut or f"the torchrun exited (rc {proc.returncode}) during the run: {_last_line(log)}"
                outcome[name] = {"error": why}
        if not started:
            why = cut or f"the torchrun exited (rc {proc.returncode}) before the first run: {_last_line(log)}"
            outcome.update({n: {"error": why} for n in pending})
            break
        pending = [n for n in pending if n not in outcome]
    return outcome


def _merge(per_rank: dict) -> dict:
    """Rank 0's losses and stats; host syncs and delayed copies of every rank; the peak of any."""
    r0 = dict(per_rank[0])
    syncs = [s for r in per_rank.values() if r.get("host_syncs") is not None for s in r["host_syncs"]]
    r0["host_syncs"] = syncs if r0.get("host_syncs") is not None else None
    if r0.get("delayed_copies") is not None:
        r0["delayed_copies"] = sum(r["delayed_copies"] or 0 for r in per_rank.values())
    peaks = [r["peak_bytes"] for r in per_rank.values() if r.get("peak_bytes") is not None]
    r0["max_peak_bytes"] = max(peaks) if peaks else None
    return r0


def _values(r: dict) -> list:
    return list(r["losses"]) + list(r["grad_norms"])


def _describe(run: Run, world: int) -> str:
    f = run.flags
    dtype = "bf16" if f.get("bf16") else "fp32"
    return f"{dtype}, L{f['num_layers']} h{f['hidden_size']} S{f['seq_length']}, {world} ranks"


def parity_row(run: Run, outcome: dict, world: int) -> tuple:
    r, ref = outcome.get(run.name, {"error": "no result"}), outcome.get(run.reference, {"error": "no result"})
    sec = r.get("seconds", 0.0)
    if "error" in r:
        return False, r["error"][:200], sec
    if "error" in ref:
        return False, f"trained {len(r['losses'])} iterations, but its reference {run.reference} failed: " \
                      f"{ref['error'][:120]}", sec
    got, want = _values(r), _values(ref)
    if run.rtol == 0.0:
        return _bitwise_row(run, r, got, want, outcome)
    if len(r["losses"]) != 3 or len(got) != len(want) or not all(map(math.isfinite, got + want)):
        return False, f"losses {r['losses']} grad norms {r['grad_norms']} vs reference {want}", sec
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return err <= run.rtol, (f"vs PP=1: losses+grad norms max rel {err:.1g} (rtol {run.rtol:g}; 3 iters; "
                             f"{_describe(run, world)})"), sec


def _bitwise_row(run: Run, r: dict, got: list, want: list, outcome: dict) -> tuple:
    sec = r.get("seconds", 0.0)
    control = outcome.get(run.control, {"error": "no result"})
    if "error" in control:
        return False, f"the control run {run.control} failed: {control['error'][:120]}", sec
    decidable = _values(control) == want
    equal = got == want
    copies = r.get("delayed_copies") or 0
    figure = (f"{copies} copies through the delay hook == no delay: {'bitwise' if equal else 'DIFFERENT'}; "
              f"the same run twice: {'bitwise' if decidable else 'DIFFERENT (nondeterministic: undecided)'}; "
              f"losses + grad norms of 3 iters")
    return equal and decidable and copies > 0, figure, sec


def syncs_row(batch: Batch, outcome: dict) -> tuple:
    """No host sync inside forward/backward in any run of the batch that counted them."""
    counted = {r.name: outcome[r.name]["host_syncs"] for r in batch.runs
               if r.sync_debug and "error" not in outcome.get(r.name, {"error": ""})
               and outcome[r.name].get("host_syncs") is not None}
    if not counted:
        return False, "no run finished with host syncs counted", 0.0
    bad = {n: s for n, s in counted.items() if s}
    if not bad:
        return True, f"0 host syncs in forward/backward over {len(counted)} runs (sync debug mode)", 0.0
    worst = sorted(bad.items(), key=lambda kv: -len(kv[1]))[:3]
    return False, "; ".join(f"{n}: {len(s)} (first at {s[0]})" for n, s in worst) + \
        f"; {len(bad)}/{len(counted)} runs synchronize the host", 0.0


def batch_rows(batch: Batch, outcome: dict) -> dict:
    rows = {r.row: parity_row(r, outcome, batch.world) for r in batch.runs if r.row}
    if batch.syncs_row:
        rows[batch.syncs_row] = syncs_row(batch, outcome)
    return rows
