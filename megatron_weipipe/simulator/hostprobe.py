"""Measure what P rank processes get from this host: CPU share and gloo transfer speed.

A CPU host has fewer cores than a run may have ranks (and is shared with other jobs),
so ranks slow each other down when they compute at the same time. `parallel_capacity`
runs the same single-threaded kernel loop in 1 and then in P processes at once and
returns the effective number of cores P processes share (P x speed_P / speed_1); the
event replay then runs busy ranks at min(1, cores / busy). `gloo_link` times gloo
send/recv between two processes (TCP on one host) for a small and a large message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from .hardware import LinkSpec

_KERNEL = textwrap.dedent("""
    import json, sys, time, torch
    torch.set_num_threads(1)
    rows, h, heads, s = (int(v) for v in sys.argv[1:5])
    seconds = float(sys.argv[5])
    x, w = torch.randn(rows, h), torch.randn(h, 4 * h)
    scores = torch.randn(heads, s, s)
    def step():
        (x @ w).relu_()
        torch.softmax(scores, -1)
    step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step(); n += 1
    print(json.dumps({"per_step": (time.perf_counter() - t0) / n}))
""")


def _run_kernels(k: int, args: list[str]) -> list[float]:
    procs = [subprocess.Popen([sys.executable, "-c", _KERNEL, *args], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(k)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=300)
        out.append(json.loads(text.strip().splitlines()[-1])["per_step"])
    return out


def parallel_capacity(processes: int, *, rows: int = 1024, hidden: int = 256, heads: int = 8, seq: int = 256,
                      seconds: float = 2.0, rounds: int = 3) -> float:
    """Effective cores `processes` concurrent single-threaded ranks share (<= processes).
    Alone and together alternate for `rounds`; the median ratio is used, since other
    jobs on a shared host come and go."""
    args = [str(rows), str(hidden), str(heads), str(seq), str(seconds)]
    ratios = []
    for _ in range(rounds):
        alone = _run_kernels(1, args)[0]
        together = _run_kernels(processes, args)
        ratios.append(alone / (sum(together) / len(together)))
    ratios.sort()
    return min(float(processes), processes * ratios[len(ratios) // 2])


_PINGPONG = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    rank, path, sizes, reps = int(sys.argv[1]), sys.argv[2], [int(v) for v in sys.argv[3].split(",")], int(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    out = {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for i in range(reps + 1):
            if i == 1:
                dist.barrier(); t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1); dist.recv(t, 1)
            else:
                dist.recv(t, 0); dist.send(t, 0)
        out[n] = (time.perf_counter() - t0) / reps / 2
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
""")


def gloo_link(small: int = 1 << 12, large: int = 1 << 24, reps: int = 20) -> LinkSpec:
    """Latency and bandwidth of one gloo message between two processes on this host."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        sizes = f"{small},{large}"
        procs = [subprocess.Popen([sys.executable, "-c", _PINGPONG, str(r), path, sizes, str(reps)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    times = {int(k): v for k, v in json.loads(outs[0].strip().splitlines()[-1]).items()}
    t_small, t_large = times[small], times[large]
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 0.0)
    return LinkSpec("gloo-loopback", bandwidth / 1e9, latency * 1e6)
