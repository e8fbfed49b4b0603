"""Two hosts on one machine (network namespaces, tools/simulator_validation/netns.py), one rank on each.

The multi-node path of the batch scripts: one ``megatron_weipipe.launch`` per host, c10d
rendezvous at the first host's name, the store on that host, gloo between the hosts
over a veth link, each host with its own hostname (so the watchdog takes its cross-host
heartbeat path, not the same-host pid check). Checked: a pipeline across the two hosts
matches the single-process reference; killing every process of one host, or cutting
its link, ends every rank on both within the documented bound with a message naming
the lost rank. And a SLURM cluster whose two nodes are these hosts (slurmctld and one
slurmd on each): the batch script runs across them, is preempted, requeues, resumes and
matches a one-node job.
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from harness.faults import PRETRAIN, ROOT, losses, tiny_args

from tools.simulator_validation import netns
from slurm_jobs import BatchJob, preempt_and_finish
from slurm_jobs import skip_reason as slurm_skip_reason

_reason = netns.available()
pytestmark = [pytest.mark.two_nodes, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

HEARTBEAT_S = 5.0
INTERVAL_S = 0.2
LAUNCHER_GRACE_S = 10.0
BOUND_S = 30.0  # beyond the heartbeat timeout: store timeouts (10 s) and process exits on 2 cores
PP2 = dict(pipeline_model_parallel_size=2, make_vocab_size_divisible_by=512, exit_signal_handler=True)


class TwoNodeJob:
    """One launcher per host; output lines per host; every process seen, by pid."""

    def __init__(self, tb: "netns.Testbed", args: list[str], port: int = 29400):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=ROOT, MEGATRON_WEIPIPE_WATCHDOG_INTERVAL=str(INTERVAL_S),
                   MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S),
                   MEGATRON_WEIPIPE_LAUNCHER_GRACE=str(LAUNCHER_GRACE_S))
        cmd = [sys.executable, "-m", "megatron_weipipe.launch", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={tb.names[0]}:{port}", "--rdzv-id=twonodes",
               "--monitor-interval=0.1", PRETRAIN, *args]
        self.lines = [[], []]
        self.seen: dict[int, set] = {0: set(), 1: set()}
        self.procs = [tb.popen(i, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                      for i in (0, 1)]
        for i, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _read(self, i, p):
        for line in p.stdout:
            self.lines[i].append(line.rstrip("\n"))

    def _sample(self):
        while not self._stop.is_set():
            for i, p in enumerate(self.procs):
                try:
                    top = psutil.Process(p.pid)
                    self.seen[i].update((q.pid, q.create_time()) for q in [top, *top.children(recursive=True)])
                except psutil.Error:
                    pass
            time.sleep(0.05)

    def output(self, i=None) -> str:
        hosts = (0, 1) if i is None else (i,)
        return "\n".join(line for h in hosts for line in self.lines[h])

    def alive(self, host: int) -> list[int]:
        out = []
        for pid, created in list(self.seen[host]):
            try:
                q = psutil.Process(pid)
                if q.create_time() == created and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.1)

    def wait_gone(self, host: int, timeout: float) -> float:
        t0 = time.monotonic()
        while self.alive(host):
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"host {host}: processes {self.alive(host)} alive after {timeout}s:\n"
                                     f"{self.output(host)[-6000:]}")
            time.sleep(0.05)
        return time.monotonic()

    def kill_host(self, host: int) -> float:
        """SIGKILL every process of this job on ``host`` (a node that vanishes)."""
        t = time.monotonic()
        for pid in self.alive(host):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        return t

    def close(self):
        self._stop.set()
        for host in (0, 1):
            for pid in self.alive(host):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def testbed():
    netns.remove_stale()
    with netns.Testbed(2) as tb:
        yield tb


@pytest.mark.timeout(300)
def test_pipeline_across_two_hosts_matches_single_process(testbed):
    job = TwoNodeJob(testbed, tiny_args(6, **PP2))
    try:
        for p in job.procs:
            assert p.wait(240) == 0, job.output()[-4000:]
    finally:
        job.close()
    got = losses(job.output())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):  # a single process of its own
        env.pop(key, None)
    ref = subprocess.run([sys.executable, PRETRAIN, *tiny_args(6, make_vocab_size_divisible_by=512)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = losses(ref.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    np.testing.assert_allclose([float(got[i]) for i in want], [float(want[i]) for i in want], rtol=5e-6, atol=0)


def _hosts_of_ranks(job):
    """The rank on each host from the launchers' environment (rank 0 is not always on host 0)."""
    ranks = {}
    for host in (0, 1):
        for pid in job.alive(host):
            try:
                q = psutil.Process(pid)
                if any(a.endswith("pretrain_gpt.py") for a in q.cmdline()) and "RANK" in q.environ():
                    ranks[host] = int(q.environ()["RANK"])
            except psutil.Error:
                pass
    return ranks


def _start_long_job(testbed):
    job = TwoNodeJob(testbed, tiny_args(100000, **PP2))
    job.wait_for("iteration        5/", 240)
    deadline = time.monotonic() + 30
    while len(ranks := _hosts_of_ranks(job)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(ranks) == 2, ranks
    # A watchdog publishes its rank's phase at its first ticks; until then a peer reads
    # "start-up", in which no heartbeat verdict is given (collective timeouts cover it).
    # Iterations here are faster than the first ticks, so let every watchdog publish.
    time.sleep(5 * INTERVAL_S + 1.0)
    return job, ranks


@pytest.mark.timeout(300)
def test_losing_a_host_stops_the_other_naming_the_lost_rank(testbed):
    job, ranks = _start_long_job(testbed)
    try:
        t0 = job.kill_host(1)
        done = job.wait_gone(0, HEARTBEAT_S + BOUND_S)
    finally:
        job.close()
    print(f"[two nodes] every process of host 0 gone {done - t0:.1f} s after host 1 was killed")
    lost = ranks[1]
    out = job.output(0)
    assert f"error: [rank {ranks[0]}] stopping: rank {lost} failed: process" in out, out[-4000:]
    assert f"on {testbed.names[1]}" in out and "no heartbeat for" in out, out[-4000:]


@pytest.mark.timeout(300)
def test_cut_link_stops_both_hosts_naming_the_lost_rank(testbed):
    job, ranks = _start_long_job(testbed)
    try:
        t0 = testbed.cut(1)
        done = [job.wait_gone(h, HEARTBEAT_S + LAUNCHER_GRACE_S + BOUND_S) for h in (0, 1)]
    finally:
        job.close()
    print(f"[two nodes] link cut: host 0 gone after {done[0] - t0:.1f} s, host 1 after {done[1] - t0:.1f} s")
    out0, out1 = job.output(0), job.output(1)
    assert f"error: [rank {ranks[0]}] stopping: rank {ranks[1]} failed: process" in out0, out0[-4000:]
    assert "no heartbeat for" in out0
    assert f"error: [rank {ranks[1]}] lost the rendezvous store" in out1, out1[-4000:]
    # torchrun's agent on the cut-off host would wait on the store for ever: the launcher ends it.
    assert "error: [launcher] this host's ranks exited" in out1, out1[-4000:]


@pytest.mark.slurm
@pytest.mark.timeout(420)
@pytest.mark.skipif(slurm_skip_reason() is not None, reason=slurm_skip_reason() or "")
def test_slurm_job_across_two_hosts_preempted_requeued_matches_one_host(testbed, tmp_path):
    import functools

    from harness.local_slurm import LocalSlurm, Node

    nodes = [Node(testbed.names[i], testbed.addr(i), functools.partial(testbed.command, i)) for i in (0, 1)]
    for d in ("cluster", "two", "one"):
        (tmp_path / d).mkdir()
    with LocalSlurm(str(tmp_path / "cluster"), nodes=nodes) as cluster:
        one = BatchJob(cluster, "examples/pretrain_gpt_slurm.sh", str(tmp_path / "one"))  # 2 ranks on one node
        two = BatchJob(cluster, "examples/pretrain_gpt_slurm.sh", str(tmp_path / "two"),
                       env={"NODES": "2", "NPROC_PER_NODE": "1", "MEGATRON_WEIPIPE_TEST_SLOW_SAVE": "6:5"})
        runs, _ = preempt_and_finish(two, 6)
        assert "world size 2 on 2 nodes" in runs[0]
        info = one.wait_done(300)
        assert info["JobState"] == "COMPLETED", one.text()[-3000:]
    assert two.losses() == one.losses() and len(one.losses()) == 24
