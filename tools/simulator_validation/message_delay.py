"""What a gloo message waits on this host beyond its bytes: the link testbed's per-message latency.

    python -m tools.simulator_validation.message_delay [--sizes 16384 65536 262144] [--compute-ms 2 5 10] [--reps 20] [--loopback]

Two ranks, each pinned to its own core with one thread as the testbed's ranks are, over
an unshaped veth pair without delayed ACKs, as the testbed's (netns.py; --loopback:
127.0.0.1). Rank 0 posts a message
(isend) and computes for a while before it waits, as the WeiPipe runtime posts its sends
ahead of the next action; rank 1 waits for it and notes when it arrived. The delay is
arrival minus posting (one host, one monotonic clock) minus the bytes' time at the link's
own rate (measured here with one large message). On this host the delays are bimodal:
most messages arrive within 0.1 ms, and many after 2 to 4 ms (a scheduler tick: gloo's
I/O thread shares its core with the compute, and the waiting receiver's core may sleep).
The mean over sizes and compute spans is the fixed cost per message that
testbed_compare.py adds to the emulated link of the
point-to-point rows. A microbenchmark of its own: no testbed row is read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

_RANK = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    rank, path, core = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sizes, spans, reps = json.loads(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    a = torch.randn(256, 256)

    def compute(ms):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ms / 1e3:
            a @ a

    def one(t, ms):  # rank 1: seconds from rank 0's isend to the arrival
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            w = dist.isend(t, 1)
            compute(ms)
            w.wait()
            dist.send(torch.tensor([t0], dtype=torch.float64), 1)
            return None
        dist.irecv(t, 0).wait()
        t1 = time.perf_counter()
        t0 = torch.zeros(1, dtype=torch.float64)
        dist.recv(t0, 0)
        return t1 - t0.item()

    big = torch.zeros(1 << 22)  # 16 MiB: the link's rate, sent while rank 0 waits
    one(big, 0)
    times = [one(big, 0) for _ in range(3)]  # both ranks take part; rank 1 holds the times
    rate = big.numel() * 4 / min(times) if rank == 1 else None
    out = {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for ms in spans:
            one(t, ms)  # warm-up
            got = [one(t, ms) for _ in range(reps)]
            if rank == 1:
                out[f"{n} {ms}"] = [max(0.0, d - n / rate) for d in got]
    if rank == 1:
        print(json.dumps({"rate": rate, "delays": out}))
    dist.destroy_process_group()
""")


def measure(sizes, spans, reps: int, loopback: bool = False, timeout: float = 300) -> dict:
    """{"rate": link bytes/s, "delays": {"SIZE MS": [seconds, ...]}} from one pair of ranks."""
    from tools.simulator_validation import netns

    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory(prefix="message_delay") as d:
        store = os.path.join(d, "store")
        argv = [[sys.executable, "-c", _RANK, str(i), store, str(cores[i % len(cores)]), json.dumps(list(sizes)),
                 json.dumps(list(spans)), str(reps)] for i in (0, 1)]
        if loopback:
            procs = [subprocess.Popen(argv[i], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for i in (0, 1)]
            return _collect(procs, timeout)
        netns.remove_stale()
        with netns.Testbed(2) as tb:
            for i in (0, 1):
                tb.quick_ack(i)  # as the link testbed runs
            procs = [tb.popen(i, argv[i], env=dict(env, GLOO_SOCKET_IFNAME="eth0"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
            return _collect(procs, timeout)


def _collect(procs, timeout: float) -> dict:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("message-delay ranks failed: " + (outs[1][1] or outs[0][1]).strip().splitlines()[-1])
    return json.loads(outs[1][0].strip().splitlines()[-1])


def mean_delay(res: dict) -> float:
    """The fixed seconds per message: the mean over every size, compute span and repeat."""
    return statistics.mean(d for ds in res["delays"].values() for d in ds)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536, 262144], help="message bytes")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[2.0, 5.0, 10.0],
                    help="how long the sender computes after posting")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--loopback", action="store_true", help="127.0.0.1 instead of a veth pair (no root needed)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.reps < 1 or min(a.sizes) < 4 or min(a.compute_ms) < 0:
        print("error: --reps >= 1, --sizes >= 4 bytes, --compute-ms >= 0", file=sys.stderr)
        return 2
    if not a.loopback:
        from tools.simulator_validation import netns

        reason = netns.available()
        if reason:
            print(f"error: {reason} (--loopback measures without namespaces)", file=sys.stderr)
            return 2
    res = measure(a.sizes, a.compute_ms, a.reps, a.loopback)
    if a.json:
        print(json.dumps({"rate": res["rate"], "mean_s": mean_delay(res), "delays": res["delays"]}))
        return 0
    print(f"# command: python -m tools.simulator_validation.message_delay {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# 2 ranks {'on loopback' if a.loopback else 'over an unshaped veth pair'}, 1 core and 1 thread each; "
          f"link rate {res['rate'] / 1e6:.0f} MB/s (16 MiB message); {a.reps} messages per row")
    print("| bytes | sender computes | mean | median | 90th percentile | max |")
    print("|---|---|---|---|---|---|")
    for key, ds in res["delays"].items():
        n, ms = key.split()
        q = sorted(ds)
        print(f"| {n} | {float(ms):g} ms | {statistics.mean(ds) * 1e3:.2f} ms | {statistics.median(ds) * 1e3:.2f} ms | "
              f"{q[int(0.9 * (len(q) - 1))] * 1e3:.2f} ms | {q[-1] * 1e3:.2f} ms |")
    print(f"\nmean over all: {mean_delay(res) * 1e3:.2f} ms per message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
