"""What a CPU host gives P rank processes: cores shared with other jobs, gloo's speed.

A CPU host has fewer cores than a run may have ranks, and this one is shared with
other jobs, so ranks slow each other down when they compute at the same time. The
replay models fair sharing: with k ranks computing and B other CPU-bound tasks, each
rank runs at min(1, cores / (k + B)). B comes from the calibration itself (the CPU time
its process got per wall second, and what /proc/stat says the others used meanwhile).
`gloo_link` times gloo send/recv between two processes (TCP on one host), and the CPU
time the two processes spend per byte (copies through the socket), which competes with
compute on a host with few cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from .hardware import LinkSpec

def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host from /proc/stat ((0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def others_cores(before: tuple[int, int], after: tuple[int, int], own_share: float, cores: int) -> float:
    """Cores other processes kept busy between two /proc/stat readings, own process excluded."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return max(0.0, busy / total * cores - own_share)


def background_tasks(cpu_share: float, others: float, cores: int, processes: int = 1) -> float:
    """CPU-bound tasks competing with the ranks (fair sharing: each of N runnable tasks gets
    cores / N), from what `processes` calibrating processes saw: each got `cpu_share` of a
    core and saw `others` cores busy besides itself (its sibling calibrators included).
    If they got less than a full core the host was saturated: N = cores / share, of which
    N - processes were others; otherwise the others' measured use is the count."""
    if cpu_share < 0.97:
        return max(0.0, cores / cpu_share - processes)
    return max(0.0, others - (processes - 1) * cpu_share)


_PINGPONG = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    rank, path, sizes, reps = int(sys.argv[1]), sys.argv[2], [int(v) for v in sys.argv[3].split(",")], int(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    out, cpu = {}, {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for i in range(reps + 1):
            if i == 1:
                dist.barrier(); t0 = time.perf_counter(); c0 = time.process_time()
            if rank == 0:
                dist.send(t, 1); dist.recv(t, 1)
            else:
                dist.recv(t, 0); dist.send(t, 0)
        out[n] = (time.perf_counter() - t0) / reps / 2
        cpu[n] = (time.process_time() - c0) / reps / 2
    print(json.dumps({"time": out, "cpu": cpu}))
    dist.destroy_process_group()
""")


def gloo_link(small: int = 1 << 12, large: int = 1 << 24, reps: int = 10) -> LinkSpec:
    """Latency and bandwidth of one gloo message between two processes on this host."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        sizes = f"{small},{large}"
        procs = [subprocess.Popen([sys.executable, "-c", _PINGPONG, str(r), path, sizes, str(reps)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(2)]
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    times = {int(k): v for k, v in outs[0]["time"].items()}
    t_small, t_large = times[small], times[large]
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 0.0)
    # CPU both processes spent per message byte (sender and receiver together)
    cpu = sum(o["cpu"][str(large)] for o in outs) / large
    return LinkSpec("gloo-loopback", bandwidth / 1e9, latency * 1e6, cpu_s_per_byte=cpu)
