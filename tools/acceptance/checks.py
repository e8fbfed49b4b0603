"""The checks of tools/gpu_acceptance.sh, in the order they run, and what each needs.

A group is one unit of work (an in-process function or one subprocess) that yields one or
more rows. ``needs`` is what the host must have: ``cpu`` (any host), ``cuda`` (a CUDA
device), ``2+gpus``, ``te`` (CUDA and Transformer Engine) or ``te+2gpus``. A group runs
only where its needs are met; otherwise each of its rows is SKIPPED with the reason.

Sizes (and so the time on one H200) are stated where each group is defined; the CUDA
groups together are sized to finish well inside 10 minutes (docs/gpu_readiness.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ENV = {"MEGATRON_WEIPIPE_FORCE_CPU": "1"}  # the CPU checks stay on the CPU on a GPU host too
# Schedule parity vs PP=1: losses and gradient norms of 3 iterations, relative.
PARITY_RTOL = {"gloo": 1e-5, "nccl": 1e-4, "te": 1e-3}
NCCL_SCHEDULES = ("1f1b", "interleaved", "weipipe-naive", "weipipe-interleave", "weipipe-zb", "fpdt-cp2")
TE_SCHEDULES = NCCL_SCHEDULES[:-1]  # FPDT builds its own local-layer spec
GLOO_SCHEDULES = NCCL_SCHEDULES  # the same runs over gloo: each run is a second or two here


@dataclass
class Host:
    gpus: int
    te: bool
    no_cuda_reason: str  # empty when CUDA is usable
    logdir: str
    deadline: float  # time.monotonic() by which every check must have ended

    def left(self, cap: float) -> float:
        return max(1.0, min(cap, self.deadline - time.monotonic()))


@dataclass
class Group:
    needs: str
    rows: tuple  # row names, in order
    run: Callable  # (host) -> {row: (ok, figure, seconds)}

    def skip_reason(self, host: Host) -> str:
        if self.needs == "cpu":
            return ""
        if host.no_cuda_reason:
            return host.no_cuda_reason
        if self.needs in ("2+gpus", "te+2gpus") and host.gpus < 2:
            return f"needs 2+ CUDA devices, found {host.gpus}"
        if self.needs.startswith("te") and not host.te:
            return "Transformer Engine is not installed"
        return ""


def _subprocess(host: Host, name: str, cmd: list, timeout: float, env: dict | None = None):
    """Run ``cmd`` (its own session, so a timeout ends all it started); log to logdir/name.log."""
    log = os.path.join(host.logdir, f"{name}.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        try:
            rc = proc.wait(timeout=host.left(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the session this call started (torchrun and its ranks)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0, log


def _guard(fn, *args):
    """One check's (ok, figure, seconds), or a FAIL naming the exception: the group's other
    rows still run."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}".splitlines()[0][:160], time.perf_counter() - t0


def _in_process(fn, *args):
    def run(host):
        return fn(host, *args)
    return run


# ---------------------------------------------------------------- CPU groups

def nccl_ordering(host):
    rc, sec, log = _subprocess(host, "nccl-ordering", [sys.executable, "tools/check_schedules.py", "--semantics", "nccl"],
                               120)
    last = open(log).read().strip().splitlines()[-1:] or ["no output"]
    figure = "every schedule deadlock-free under NCCL semantics" if rc == 0 else last[0][:120]
    return {"nccl-ordering": (rc == 0, figure, sec)}


def kernels(host, device, names):
    """Rows fpdt-kernel-<device>-<dtype> and fpdt-chunked-<device>-<dtype>."""
    import torch

    from acceptance.kernels import chunked_check, kernel_check

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def one(name):
        kind, dt = name.split("-")[1], name.rsplit("-", 1)[1]
        return (kernel_check if kind == "kernel" else chunked_check)(device, dtypes[dt])

    return {name: _guard(one, name) for name in names}


def layer_parity(host, impl_b, rows):
    """tools/acceptance/layer_parity.py: local vs ``impl_b``, one row per dtype."""
    env = CPU_ENV if impl_b == "local" else {}
    rc, sec, log = _subprocess(host, rows[0], [sys.executable, "tools/acceptance/layer_parity.py",
                                               "--impl-b", impl_b], 300, env)
    results = [json.loads(ln) for ln in open(log) if ln.startswith("{")]
    out = {row: (False, f"no result (rc {rc}; see {log})", sec) for row in rows}
    for row, r in zip(rows, results):
        fig = (f"{r['dtype']}: worst {r['worst']} rel {r['err']:.2g} (tol {r['tol']:g}; {r['compared']}/{r['params'] + 2} tensors; "
               f"{r['shape']})" + (f"; unmapped {r['missing']}" if r["missing"] else ""))
        out[row] = (r["ok"], fig, r["seconds"])
    return out


def schedule_parity(host, backend, schedules, te=False):
    """One torchrun over min(GPUs, 2) ranks (2 gloo processes here): PP=1, then each schedule."""
    prefix = "te-nccl-parity" if te else f"{backend}-parity"
    out_file = os.path.join(host.logdir, f"{prefix}.jsonl")
    if os.path.exists(out_file):
        os.remove(out_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tools/acceptance/parity_worker.py", "--backend", backend, "--out", out_file, "reference", *schedules]
    rc, sec, log = _subprocess(host, prefix, cmd + (["--te"] if te else []), 300,
                               CPU_ENV if backend == "gloo" else None)
    runs = {}
    if os.path.exists(out_file):
        runs = {r["name"]: r for r in map(json.loads, open(out_file))}
    rtol = PARITY_RTOL["te" if te else backend]
    ref = runs.get("reference")
    out = {}
    for s in schedules:
        r = runs.get(s)
        if ref is None or "error" in ref:
            out[f"{prefix}-{s}"] = (False, f"the PP=1 reference did not finish (see {log})", sec)
        elif r is None or "error" in r:
            why = r["error"].strip().splitlines()[-1][:100] if r else f"no result (rc {rc}; see {log})"
            out[f"{prefix}-{s}"] = (False, why, sec)
        else:
            pairs = list(zip(r["losses"] + r["grad_norms"], ref["losses"] + ref["grad_norms"]))
            err = max(abs(a - b) / abs(b) for a, b in pairs)
            ok = len(r["losses"]) == len(ref["losses"]) == 3 and err <= rtol
            out[f"{prefix}-{s}"] = (ok, f"vs PP=1: losses+grad norms max rel {err:.1g} (rtol {rtol:g}; 3 iters, "
                                        f"2 ranks)", r["seconds"])
    return out


# ---------------------------------------------------------------- CUDA groups

def offload_and_rng(host):
    import torch

    from acceptance.kernels import offload_check, rng_replay_check

    return {"fpdt-offload-overlap-cuda-fp32": _guard(offload_check, "cuda", torch.float32),
            "fpdt-offload-overlap-cuda-bf16": _guard(offload_check, "cuda", torch.bfloat16),
            "rng-replay-cuda": _guard(rng_replay_check, "cuda")}


def bench(host):
    # Overhead at S=32K (Llama-3-8B layer) and the longest-S search capped at 256K: ~2-3 min.
    cmd = [sys.executable, "bench/fpdt_gpu.py", "--rounds", "3", "--max-seq", "262144", "--bisect-steps", "1"]
    rc, sec, log = _subprocess(host, "fpdt-gpu-bench", cmd, 300)
    kern = [ln for ln in open(log) if ln.startswith("kernel ")]
    figure = (kern[-1].strip() if kern else "tables in the log") + f"; log {log}"
    return {"fpdt-gpu-bench": (rc == 0, figure, sec)}


def groups() -> list[Group]:
    kc = ("fpdt-kernel-cpu-fp32", "fpdt-kernel-cpu-bf16", "fpdt-chunked-cpu-fp32", "fpdt-chunked-cpu-bf16")
    kg = ("fpdt-kernel-cuda-bf16", "fpdt-chunked-cuda-fp32", "fpdt-chunked-cuda-bf16")
    return [
        Group("cpu", ("nccl-ordering",), nccl_ordering),
        Group("cpu", kc, _in_process(kernels, "cpu", kc)),
        Group("cpu", ("layer-parity-harness-fp32", "layer-parity-harness-bf16"),
              _in_process(layer_parity, "local", ("layer-parity-harness-fp32", "layer-parity-harness-bf16"))),
        Group("cpu", tuple(f"gloo-parity-{s}" for s in GLOO_SCHEDULES),
              _in_process(schedule_parity, "gloo", GLOO_SCHEDULES)),
        # CUDA kernels: S 512 / 2x256 blocks and S 16K h1024 for the overlap: seconds.
        Group("cuda", kg, _in_process(kernels, "cuda", kg)),
        Group("cuda", ("fpdt-offload-overlap-cuda-fp32", "fpdt-offload-overlap-cuda-bf16", "rng-replay-cuda"),
              offload_and_rng),
        # One process, 2-layer h256 model, two dtypes: under a minute with start-up.
        Group("te", ("te-parity-fp32", "te-parity-bf16"),
              _in_process(layer_parity, "transformer_engine", ("te-parity-fp32", "te-parity-bf16"))),
        # One torchrun each: start-up plus 7 (6) tiny 3-iteration runs, about a minute each.
        Group("2+gpus", tuple(f"nccl-parity-{s}" for s in NCCL_SCHEDULES),
              _in_process(schedule_parity, "nccl", NCCL_SCHEDULES)),
        Group("te+2gpus", tuple(f"te-nccl-parity-{s}" for s in TE_SCHEDULES),
              _in_process(schedule_parity, "nccl", TE_SCHEDULES, True)),
        Group("cuda", ("fpdt-gpu-bench",), bench),
    ]
