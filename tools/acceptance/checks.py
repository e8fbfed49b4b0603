"""The checks of tools/gpu_acceptance.sh, in table order, and what each needs.

A group is one unit of work (an in-process function, one subprocess, or one parity batch
of torchruns) that yields one or more rows. ``needs`` is what the host must have: ``cpu``
(any host), ``cuda`` (a CUDA device), ``N+gpus`` (N CUDA devices: NCCL refuses two ranks
on one GPU), ``te`` (CUDA and Transformer Engine) or ``te+N+gpus``. A group runs only
where its needs are met; otherwise each of its rows is SKIPPED with the reason.

``gpus`` is how many GPUs a group holds while it runs (0: none, "all": every one the host
has); ``inline`` groups run first, in this process (on GPU 0). The others run side by
side on disjoint GPUs (python -m tools.gpu_acceptance). Sizes and times are stated where each
group is defined and in docs/reference/gpu-readiness.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

from tools.acceptance import parity_runs
from tools.acceptance.parity import CPU_ENV, batch_rows, run_batch, stop_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = parity_runs.SCHEDULES


@dataclass
class Host:
    gpus: int
    te: bool
    no_cuda_reason: str  # empty when CUDA is usable
    logdir: str
    deadline: float  # time.monotonic() by which every check must have ended
    gpu_name: str = ""
    devices: Optional[tuple] = None  # the GPUs a running group holds (indices into the visible ones)

    def left(self, cap: float) -> float:
        return max(1.0, min(cap, self.deadline - time.monotonic()))

    def device_env(self) -> dict:
        """CUDA_VISIBLE_DEVICES for a subprocess of a group that holds ``devices``."""
        if self.devices is None:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(self.devices) + 1)]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[i] for i in self.devices)}

    def holding(self, devices) -> "Host":
        return replace(self, devices=tuple(devices))


def min_gpus(needs: str) -> int:
    m = re.search(r"(\d+)\+?gpus", needs)
    return int(m.group(1)) if m else (0 if needs == "cpu" else 1)


@dataclass
class Group:
    needs: str
    rows: tuple  # row names, in order
    run: Callable  # (host) -> {row: (ok, figure, seconds)}
    gpus: Union[int, str] = 0  # GPUs held while it runs; "all": every GPU of the host
    inline: bool = False
    also_skip: Optional[Callable] = None  # (host) -> a reason to skip on a host that meets ``needs``, or ""
    expect_s: float = 10.0  # about how long it runs on H200s: the longest start first

    def skip_reason(self, host: Host) -> str:
        if self.needs == "cpu":
            return ""
        if host.no_cuda_reason:
            return host.no_cuda_reason
        n = min_gpus(self.needs)
        if n > 1 and host.gpus < n:
            return f"needs {n}+ CUDA devices, found {host.gpus}"
        if self.needs.startswith("te") and not host.te:
            return "Transformer Engine is not installed"
        return self.also_skip(host) if self.also_skip else ""

    def held(self, host: Host) -> int:
        if self.needs == "cpu":
            return 0
        return host.gpus if self.gpus == "all" else int(self.gpus)


def _subprocess(host: Host, name: str, cmd: list, timeout: float, env: dict | None = None):
    """Run ``cmd`` (a timeout ends all it started); log to logdir/name.log."""
    log = os.path.join(host.logdir, f"{name}.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", **host.device_env(), **(env or {})})
        try:
            rc = proc.wait(timeout=host.left(timeout))
        except subprocess.TimeoutExpired:
            stop_tree(proc)
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


# ---------------------------------------------------------------- checks

def nccl_ordering(host):
    rc, sec, log = _subprocess(host, "nccl-ordering", [sys.executable, "-m", "tools.check_schedules", "--semantics", "nccl"],
                               120)
    last = open(log).read().strip().splitlines()[-1:] or ["no output"]
    figure = "every schedule deadlock-free under NCCL semantics" if rc == 0 else last[0][:120]
    return {"nccl-ordering": (rc == 0, figure, sec)}


def kernels(host, device, names):
    """Rows fpdt-kernel-<device>[-<kernel>]-<dtype> and fpdt-chunked-<device>-<dtype>."""
    import torch

    from tools.acceptance.kernels import chunked_check, kernel_check

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def one(name):
        parts = name.split("-")  # fpdt, kind, device, [kernel], dtype
        kind, dt = parts[1], parts[-1]
        if kind == "kernel":
            return kernel_check(device, dtypes[dt], kernel="-".join(parts[3:-1]) or "auto")
        return chunked_check(device, dtypes[dt])

    return {name: _guard(one, name) for name in names}


def layer_parity(host, impl_b, rows):
    """tools/acceptance/layer_parity.py: local vs ``impl_b``, one row per dtype."""
    env = CPU_ENV if impl_b == "local" else {}
    rc, sec, log = _subprocess(host, rows[0], [sys.executable, "-m", "tools.acceptance.layer_parity",
                                               "--impl-b", impl_b], 300, env)
    results = [json.loads(ln) for ln in open(log) if ln.startswith("{")]
    out = {row: (False, f"no result (rc {rc}; see {log})", sec) for row in rows}
    for row, r in zip(rows, results):
        fig = (f"{r['dtype']}: worst {r['worst']} rel {r['err']:.2g} (tol {r['tol']:g}; {r['compared']}/{r['params'] + 2} tensors; "
               f"{r['shape']})" + (f"; unmapped {r['missing']}" if r["missing"] else ""))
        out[row] = (r["ok"], fig, r["seconds"])
    return out


def parity_batch(host, make_batch: Callable):
    """A parity batch's rows (tools/acceptance/parity.py); ``make_batch(host)`` sizes it."""
    batch = make_batch(host)
    return batch_rows(batch, run_batch(host, batch))


def schedule_parity(host, backend, schedules, te=False):
    """PP = 1 and then each of ``schedules`` (a schedule or feature name) over 2 ranks,
    tiny model, fp32: rows ``<backend>-parity-<name>`` (``te-nccl-parity-*`` with ``te``)."""
    full = parity_runs.te_batch() if te else parity_runs.p2_batch(backend, sync_debug=False)
    by_name = {r.name: r for r in full.runs}
    runs = (by_name["reference"], *(by_name[f"reference:{s}"] for s in schedules))  # in the order given
    batch = replace(full, runs=runs, syncs_row="")
    return batch_rows(batch, run_batch(host, batch))


def _ring_n(host):
    return parity_runs.ring_batch("nccl", host.gpus, "pN")


def _not_four(host):
    return "" if host.gpus != 4 else "the GPU count is 4: the nccl-parity-p4 rows are that ring"


def offload_and_rng(host):
    import torch

    from tools.acceptance.kernels import delayed_copy_check, offload_check, rng_replay_check

    return {"fpdt-offload-overlap-cuda-fp32": _guard(offload_check, "cuda", torch.float32),
            "fpdt-offload-overlap-cuda-bf16": _guard(offload_check, "cuda", torch.bfloat16),
            "fpdt-offload-delayed-copy-cuda-fp32": _guard(delayed_copy_check, "cuda", torch.float32),
            "fpdt-offload-delayed-copy-cuda-bf16": _guard(delayed_copy_check, "cuda", torch.bfloat16),
            "rng-replay-cuda": _guard(rng_replay_check, "cuda")}


def bench(host):
    # Overhead at S=32K (Llama-3-8B layer) and the longest-S search capped at 256K: ~2-3 min.
    cmd = [sys.executable, "-m", "bench.fpdt_gpu", "--rounds", "3", "--max-seq", "262144", "--bisect-steps", "1"]
    rc, sec, log = _subprocess(host, "fpdt-gpu-bench", cmd, 300)
    kern = [ln for ln in open(log) if ln.startswith("kernel ")]
    figure = (kern[-1].strip() if kern else "tables in the log") + f"; log {log}"
    return {"fpdt-gpu-bench": (rc == 0, figure, sec)}


def _cuda_kernel_rows() -> tuple:
    """One self-check row per CUDA block kernel FPDT may choose (fpdt/kernels.py)."""
    import torch

    from megatron_weipipe.fpdt.kernels import cuda_kernels

    return tuple(f"fpdt-kernel-cuda-{k}-{dt}" for dt, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
                 for k in sorted(cuda_kernels(dtype)))


def groups() -> list[Group]:
    from tools.acceptance import example_runs

    kc = ("fpdt-kernel-cpu-fp32", "fpdt-kernel-cpu-bf16", "fpdt-chunked-cpu-fp32", "fpdt-chunked-cpu-bf16")
    kg = ("fpdt-kernel-cuda-bf16", *_cuda_kernel_rows(), "fpdt-chunked-cuda-fp32", "fpdt-chunked-cuda-bf16")
    offload = ("fpdt-offload-overlap-cuda-fp32", "fpdt-offload-overlap-cuda-bf16",
               "fpdt-offload-delayed-copy-cuda-fp32", "fpdt-offload-delayed-copy-cuda-bf16", "rng-replay-cuda")
    harness = ("layer-parity-harness-fp32", "layer-parity-harness-bf16")
    te_rows = ("te-parity-fp32", "te-parity-bf16")
    gloo2, gloo3 = parity_runs.p2_batch("gloo", sync_debug=False), parity_runs.ring_batch("gloo", 3, "p3")
    nccl2, nccl4 = parity_runs.p2_batch("nccl", sync_debug=True), parity_runs.ring_batch("nccl", 4, "p4")
    ring_n, te2, one = parity_runs.ring_batch("nccl", 3, "pN"), parity_runs.te_batch(), parity_runs.one_gpu_batch()
    return [
        # CPU: seconds each; the gloo batches are one torchrun of 2 (3) processes, ~1 s a run.
        Group("cpu", ("nccl-ordering",), nccl_ordering),
        Group("cpu", kc, _in_process(kernels, "cpu", kc), inline=True),
        Group("cpu", harness, _in_process(layer_parity, "local", harness)),
        Group("cpu", gloo2.rows, _in_process(parity_batch, lambda h: gloo2), expect_s=60),
        Group("cpu", gloo3.rows, _in_process(parity_batch, lambda h: gloo3), expect_s=30),
        # CUDA kernels: S 512 / 2x256 blocks; the overlap and delayed copies at S 16K h1024: seconds.
        Group("cuda", kg, _in_process(kernels, "cuda", kg), gpus=1, inline=True),
        Group("cuda", offload, offload_and_rng, gpus=1, inline=True),
        # Every GPU: the ring of P = N (skipped where N is 4: the p4 batch), then the examples.
        Group("3+gpus", ring_n.rows, _in_process(parity_batch, _ring_n), gpus="all", also_skip=_not_four,
              expect_s=130),
        Group("cuda", example_runs.ROWS, example_runs.run, gpus="all", expect_s=170),
        Group("2+gpus", nccl2.rows, _in_process(parity_batch, lambda h: nccl2), gpus=2, expect_s=120),
        Group("4+gpus", nccl4.rows, _in_process(parity_batch, lambda h: nccl4), gpus=4, expect_s=100),
        Group("te+2gpus", te2.rows, _in_process(parity_batch, lambda h: te2), gpus=2, expect_s=60),
        # One process, 2-layer h256 model, two dtypes: under a minute with start-up.
        Group("te", te_rows, _in_process(layer_parity, "transformer_engine", te_rows), gpus=1, expect_s=45),
        Group("cuda", one.rows, _in_process(parity_batch, lambda h: one), gpus=1, expect_s=40),
        Group("cuda", ("fpdt-gpu-bench",), bench, gpus=1, expect_s=150),
    ]
