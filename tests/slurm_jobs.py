"""Submit the example batch scripts to a local SLURM cluster and watch their output files.

Shared by tests/test_slurm_batch.py and tests/test_two_nodes.py: the scripts are
submitted through examples/slurm_cpu.sh (the real scripts with CPU resources and a tiny
model set by environment variables), every wait is bounded, and the processes of a job
are found by the job id in their environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Optional

import psutil

from harness.faults import ROOT, free_port, losses

CPU_SUBMIT = os.path.join(ROOT, "examples", "slurm_cpu.sh")
TRAIN_ITERS = 24


def skip_reason() -> Optional[str]:
    from harness.local_slurm import missing_binaries

    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root"
    missing = missing_binaries()
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): run tools/install_slurm.sh"
    return None


class BatchJob:
    """One submission; ``text()`` is its output file (all runs of a requeued job, appended)."""

    def __init__(self, cluster, script: str, workdir: str, env: Optional[dict] = None,
                 sbatch_args: tuple = ()):
        self.cluster = cluster
        self.out = os.path.join(workdir, "job.out")
        self.ckpt = os.path.join(workdir, "ckpt")
        job_env = {**cluster.env, "CKPT": self.ckpt, "MASTER_PORT": str(free_port()),
                   "TRAIN_ITERS": str(TRAIN_ITERS), "SAVE_INTERVAL": "5",
                   "MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2", **(env or {})}
        cmd = ["bash", CPU_SUBMIT, os.path.join(ROOT, script), "--parsable", f"--output={self.out}",
               f"--job-name={os.path.basename(workdir)}", *sbatch_args]
        if cluster.wrap:  # submitted from the controller's host
            cmd = cluster.wrap(cmd)
        self.submitted = time.monotonic()
        r = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}"
        self.id = int(r.stdout.strip().split(";")[0])

    def text(self) -> str:
        try:
            with open(self.out, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_line(self, pattern: str, timeout: float, count: int = 1) -> float:
        """Wait until ``pattern`` has matched ``count`` lines; returns time.monotonic() then.
        A requeued job held by SLURM meanwhile is released at once."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            if len(rx.findall(self.text())) >= count:
                return time.monotonic()
            polls += 1
            if polls % 10 == 0:
                info = self.cluster.job(self.id)
                if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                    self.cluster.release(self.id)
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: no {count} line(s) matching {pattern!r} within {timeout}s; "
                                     f"state {self.cluster.job(self.id).get('JobState')}; output:\n"
                                     f"{self.text()[-4000:]}\n{self.cluster.logs(1500)}")
            time.sleep(0.1)

    def runs(self) -> list[str]:
        """The output of each run of the job (split at the script's first line)."""
        parts = re.split(r"^(?=.* run \d+ of job )", self.text(), flags=re.M)
        return [p for p in parts if re.match(r".* run \d+ of job ", p)]

    def losses(self) -> dict[int, str]:
        return losses(self.text())

    def rank_pids(self) -> dict[int, int]:
        """Global rank -> pid of this job's training processes (this cluster's, this job's)."""
        out = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if not any(a.endswith("pretrain_gpt.py") for a in p.info["cmdline"] or []):
                    continue
                env = p.environ()
                ours = env.get("SLURM_CONF") == self.cluster.conf and env.get("SLURM_JOB_ID") == str(self.id)
                if ours and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
                    out[int(env["RANK"])] = p.pid
            except psutil.Error:
                pass
        return out

    def wait_ranks(self, n: int, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.rank_pids()
            if len(pids) >= n:
                return pids
            time.sleep(0.2)
        raise AssertionError(f"job {self.id}: {n} ranks not found within {timeout}s: {self.rank_pids()}")

    def wait_done(self, timeout: float) -> dict:
        return self.cluster.wait_state(self.id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"},
                                       timeout)


def report(name: str, seconds: float) -> None:
    print(f"[slurm timing] {name}: {seconds:.1f} s")


def preempt_and_finish(job: BatchJob, hold_s: float) -> list[str]:
    """SIGTERM to the batch shell while the save of iteration 5 is held (the job was submitted
    with MEGATRON_WEIPIPE_TEST_SLOW_SAVE=<hold_s>:5), then requeue and run to the end.
    Checks the job's own account of it; returns the output of its two runs and the
    iteration it stopped at."""
    cluster = job.cluster
    first = job.wait_line(r"iteration\s+1/", 240)
    report("submit to first iteration", first - job.submitted)
    job.wait_line(r"\[test hook\] rank \d+ pausing", 120)
    t_signal = time.monotonic()
    cluster.run(["scancel", "--signal=TERM", "--batch", str(job.id)])
    job.wait_line(r"exiting at iteration \d+ \(signal", hold_s + 120)
    cluster.wait_state(job.id, {"PENDING", "REQUEUED", "REQUEUE_HOLD"}, 120, release=False)
    report("signal to requeued, less the held save", time.monotonic() - t_signal - hold_s)
    t_release = time.monotonic()
    cluster.release(job.id)
    job.wait_line(r"loaded checkpoint from", 240)
    job.wait_line(r"iteration\s+\d+/", 240, count=len(re.findall(r"iteration\s+\d+/", job.text())) + 1)
    report("requeue to first resumed iteration (2 s of it before the release)", time.monotonic() - t_release)
    info = job.wait_done(240)
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    runs = job.runs()
    assert len(runs) == 2, text[-3000:]
    # The signal arrives during the held save of 5: the ranks stop after the next iteration.
    stop = int(re.search(r"exiting at iteration (\d+) \(signal: SIGTERM received", runs[0]).group(1))
    assert 6 <= stop < TRAIN_ITERS
    assert f"step exited with status 0; latest checkpoint at iteration {stop} of" in runs[0]
    assert "requeueing job" in runs[0]
    assert f"loaded checkpoint from {job.ckpt} at iteration {stop}" in runs[1], runs[1][-3000:]
    assert f"latest checkpoint at iteration {TRAIN_ITERS} of {TRAIN_ITERS}" in runs[1]
    return runs, stop
