"""A rank that dies (SIGKILL) or raises takes the whole job down quickly, with its name.

Measured: the time from the kill to the moment no process of the job (launcher,
ranks, their children, orphans included) exists any more.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from harness.faults import ROOT, Job, tiny_args

# The watchdog polls every 0.2 s here (1 s by default); on one host a dead neighbour is
# found by its pid at once, so the bound does not depend on the heartbeat timeout.
ENV = {"MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"}
BOUND_S = 20.0
PP3 = dict(num_layers=3, pipeline_model_parallel_size=3, global_batch_size=6)


def _kill_and_measure(job: Job, rank: int, after_iteration: int) -> float:
    pids = job.wait_ranks(90)
    job.wait_for(rf"iteration\s+{after_iteration}/", 120)
    job.sample()
    t0 = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL)
    job.wait_all_gone(BOUND_S + 30)
    elapsed = time.monotonic() - t0
    print(f"all processes gone {elapsed:.2f}s after SIGKILL of rank {rank}")
    return elapsed


@pytest.mark.timeout(180)
def test_sigkill_one_rank_under_torchrun():
    # With --exit-signal-handler torchrun's SIGTERM to the survivors does not stop them;
    # the watchdog does.
    job = Job(2, tiny_args(100000, exit_signal_handler=True), env=ENV)
    try:
        elapsed = _kill_and_measure(job, rank=1, after_iteration=5)
        codes = job.wait(10)
    finally:
        job.close()
    assert codes[0] != 0
    assert elapsed < BOUND_S
    out = job.output()
    assert "error: [rank 0] stopping: rank 1 failed: process" in out and "died" in out, out[-3000:]


@pytest.mark.timeout(180)
def test_sigkill_one_rank_without_a_launcher():
    """One process per rank (as under srun): only the watchdog and gloo can end the job."""
    job = Job(3, tiny_args(100000, **PP3), torchrun=False, env=ENV)
    try:
        elapsed = _kill_and_measure(job, rank=1, after_iteration=5)
        codes = job.wait(10)
    finally:
        job.close()
    assert codes == [1, -signal.SIGKILL, 1]
    assert elapsed < BOUND_S
    out = job.output()
    for survivor in (0, 2):
        assert f"error: [rank {survivor}] stopping: rank 1 failed: process" in out, out[-3000:]
    assert "its last heartbeat: " in out


@pytest.mark.timeout(180)
def test_rank_that_raises_tells_its_peers():
    env = dict(ENV, MEGATRON_WEIPIPE_TEST_RAISE="8:2")
    job = Job(3, tiny_args(100000, **PP3), torchrun=False, env=env)
    try:
        job.wait_for(r"injected failure", 120)
        t0 = time.monotonic()
        job.wait_all_gone(BOUND_S + 30)
        elapsed = time.monotonic() - t0
        codes = job.wait(10)
    finally:
        job.close()
    print(f"all processes gone {elapsed:.2f}s after rank 2 raised")
    assert codes == [1, 1, 1]
    assert elapsed < BOUND_S
    out = job.output()
    assert "error: [rank 2] failed during forward/backward at iteration 8: RuntimeError: injected failure" in out
    for peer in (0, 1):
        assert (f"error: [rank {peer}] stopping: rank 2 failed: RuntimeError during forward/backward at "
                f"iteration 8") in out, out[-3000:]


_FORKS_A_CHILD = """
import multiprocessing as mp, time
from megatron_weipipe.training.watchdog import install_child_process_guards
install_child_process_guards()
p = mp.get_context("fork").Process(target=time.sleep, args=(60,))
p.start()
print(p.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_forked_children_die_with_their_rank():
    """Checkpoint writers and loader workers are forked by multiprocessing: they must not outlive a SIGKILLed rank."""
    import psutil

    env = dict(os.environ, PYTHONPATH=ROOT)
    rank = subprocess.Popen([sys.executable, "-c", _FORKS_A_CHILD], env=env, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(rank.stdout.readline()))
        rank.kill()
        rank.wait(10)
        child.wait(10)  # raises TimeoutExpired if the child outlives its parent
    finally:
        if rank.poll() is None:
            rank.kill()
        if child is not None and child.is_running():
            child.kill()


@pytest.mark.timeout(180)
def test_frozen_rank_is_found_by_its_heartbeat():
    """SIGSTOP: the process exists but does nothing; its heartbeat stops and it is declared dead."""
    env = dict(ENV, MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT="3")
    job = Job(3, tiny_args(100000, **PP3), torchrun=False, env=env)
    try:
        pids = job.wait_ranks(90)
        job.wait_for(r"iteration\s+5/", 120)
        # Until rank 2's watchdog has published a phase past start-up (its first ticks),
        # its watcher gives no heartbeat verdict: collective timeouts cover start-up.
        time.sleep(5 * float(ENV["MEGATRON_WEIPIPE_WATCHDOG_INTERVAL"]) + 1.0)
        job.sample()
        t0 = time.monotonic()
        os.kill(pids[2], signal.SIGSTOP)
        job.wait_all_gone(BOUND_S + 30)
        elapsed = time.monotonic() - t0
        codes = job.wait(10)
    finally:
        job.close()
    print(f"all processes gone {elapsed:.2f}s after SIGSTOP of rank 2")
    assert codes == [1, 1, -signal.SIGKILL]
    assert elapsed < 3 + BOUND_S
    out = job.output()
    assert "stopping: rank 2 failed: process" in out and "stopped responding: no heartbeat for" in out, out[-3000:]
