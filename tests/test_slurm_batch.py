"""The example batch scripts under a real SLURM scheduler (slurmctld + slurmd on this host).

Each script is submitted with sbatch through examples/slurm_cpu.sh (the same script,
CPU resources and a tiny model set by environment variables). Preemption: SIGTERM to
the batch shell (what ``--signal=B:TERM@N`` does before the time limit), sent while a
save is held open by a test hook so the job cannot finish first. The job must save,
exit 0, requeue itself, resume, finish, and log the same losses, iteration by iteration,
as an uninterrupted job. A crash (SIGKILL of a rank) must restart the job from the last
checkpoint at most MAX_CRASH_RESTARTS times, then stop with a clear message.
"""

import os
import signal
import time

import pytest

from slurm_jobs import TRAIN_ITERS, BatchJob, preempt_and_finish, report, skip_reason
from harness.faults import losses

_reason = skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

HOLD_S = 6  # the save of iteration 5 pauses this long: the signal arrives while it waits
SCRIPTS = ["examples/pretrain_gpt_slurm.sh", "examples/slurm_requeue.sh"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from harness.local_slurm import LocalSlurm

    import psutil

    c = LocalSlurm(str(tmp_path_factory.mktemp("slurm"))).start()
    try:
        yield c
    finally:
        started = c.pids()
        c.stop()
    assert started and not [p for p in started if psutil.pid_exists(p)], "SLURM processes outlived the cluster"


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """An uninterrupted job, submitted once and read when first needed."""
    job = BatchJob(cluster, SCRIPTS[0], str(tmp_path_factory.mktemp("reference")))
    done = {}

    def get():
        if not done:
            info = job.wait_done(300)
            assert info["JobState"] == "COMPLETED", job.text()[-3000:]
            done.update(job.losses())
            assert sorted(done) == list(range(1, TRAIN_ITERS + 1))
        return done

    return get


@pytest.mark.timeout(420)
@pytest.mark.parametrize("script", SCRIPTS)
def test_preempted_job_requeues_resumes_and_matches_uninterrupted(cluster, reference, tmp_path, script):
    job = BatchJob(cluster, script, str(tmp_path), env={"MEGATRON_WEIPIPE_TEST_SLOW_SAVE": f"{HOLD_S}:5"})
    _, stop = preempt_and_finish(job, HOLD_S)
    # Iteration by iteration, to the printed digits: the requeued job is the uninterrupted one.
    assert job.losses() == reference()
    saved = sorted({5, stop, 10, 15, 20, TRAIN_ITERS})
    assert sorted(os.listdir(job.ckpt)) == [f"iter_{i:07d}" for i in saved] + ["latest_checkpointed_iteration.txt"]


@pytest.mark.timeout(420)
def test_crash_restarts_from_last_checkpoint_then_gives_up(cluster, reference, tmp_path):
    """SIGKILL of rank 1 while iteration 10 is being saved: requeued once, resumed from 5; again: stop."""
    job = BatchJob(cluster, SCRIPTS[0], str(tmp_path),
                   env={"MEGATRON_WEIPIPE_TEST_SLOW_SAVE": f"{HOLD_S}:10", "MAX_CRASH_RESTARTS": "1"})
    for run in (1, 2):
        job.wait_line(r"\[test hook\] rank 1 pausing", 240, count=run)
        pids = job.wait_ranks(2, 30)
        t_kill = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        job.wait_line(r"step exited with status", 120, count=run)
        report(f"SIGKILL of a rank to step exit (run {run})", time.monotonic() - t_kill)
        if run == 1:
            cluster.wait_state(job.id, {"PENDING", "RUNNING"}, 120)  # requeued, released at once
    info = job.wait_done(120)
    text = job.text()
    assert info["JobState"] == "FAILED", (info, text[-3000:])
    runs = job.runs()
    assert len(runs) == 2, text[-3000:]
    for r in runs:
        assert "stopping: rank 1 failed: process" in r and "died" in r, r[-3000:]
        assert "latest checkpoint at iteration 5 of" in r, r[-3000:]
    assert "crash 1 of at most 1 restarts" in runs[0] and "requeueing job" in runs[0]
    assert "giving up after 1 restarts" in runs[1] and "requeueing" not in runs[1], runs[1][-3000:]
    assert f"loaded checkpoint from {job.ckpt} at iteration 5" in runs[1]
    # The second run computed iterations 6..10 again from the checkpoint of 5, as the reference did.
    ref = reference()
    assert losses(runs[0]) == {i: ref[i] for i in range(1, 11)}
    assert losses(runs[1]) == {i: ref[i] for i in range(6, 11)}
