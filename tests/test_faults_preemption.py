"""Preemption: SIGTERM, --exit-duration-in-mins and torchrun's own signal handling.

Real processes under torchrun, real signals. A constant learning rate and one long
--train-iters for every run make the interrupted, resumed and uninterrupted runs
follow the same schedule, so their losses must agree digit for digit.
"""

import os
import random
import signal
import subprocess
import sys

import pytest

from harness.faults import PRETRAIN, ROOT, Job, losses, tiny_args, tracker

COMMON = dict(lr_decay_style="constant", hidden_dropout=0.1, attention_dropout=0.1)
FAST_WATCHDOG = {"MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"}


@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_saves_there_and_resume_matches_uninterrupted(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    k = random.Random().randint(2, 8)
    print(f"SIGTERM after iteration {k}")
    job = Job(2, tiny_args(1000, save=ckpt, exit_signal_handler=True, **COMMON), env=FAST_WATCHDOG)
    try:
        pids = job.wait_ranks(90)
        job.wait_for(rf"iteration\s+{k}/", 120)
        os.kill(pids[1], signal.SIGTERM)  # one rank only: the others learn it in the next all-reduce
        assert job.wait(120) == [0], job.output()[-3000:]
        job.wait_all_gone(10)
    finally:
        job.close()
    stop = int(job.wait_for(r"exiting at iteration (\d+) \(signal", 1).group(1))
    assert stop >= k
    assert tracker(ckpt) == stop
    assert sorted(os.listdir(ckpt)) == [f"iter_{stop:07d}", "latest_checkpointed_iteration.txt"]
    first = losses(job.output())
    assert sorted(first) == list(range(1, stop + 1))

    end = stop + 3
    # The resumed and the uninterrupted runs need no launcher: one process per rank is quicker.
    resumed = Job(2, tiny_args(1000, save=ckpt, load=ckpt, exit_interval=end, **COMMON), env=FAST_WATCHDOG,
                  torchrun=False)
    straight = None
    try:
        assert resumed.wait(120) == [0, 0], resumed.output()[-3000:]
        straight = Job(2, tiny_args(1000, exit_interval=end, **COMMON), env=FAST_WATCHDOG, torchrun=False)
        assert straight.wait(120) == [0, 0], straight.output()[-3000:]
    finally:
        resumed.close()
        if straight is not None:
            straight.close()
    second = losses(resumed.output())
    assert sorted(second) == list(range(stop + 1, end + 1))
    reference = losses(straight.output())
    assert {**first, **second} == reference
    assert tracker(ckpt) == end


@pytest.mark.timeout(180)
def test_sigterm_to_the_launcher_exits_zero_with_a_checkpoint(tmp_path):
    """torchrun itself would exit 1 here; megatron_weipipe.launch lets the ranks finish."""
    ckpt = str(tmp_path / "ckpt")
    job = Job(2, tiny_args(1000, save=ckpt, exit_signal_handler=True, **COMMON),
              launcher="megatron_weipipe.launch", env=FAST_WATCHDOG)
    try:
        job.wait_ranks(90)
        job.wait_for(r"iteration\s+3/", 120)
        os.kill(job.procs[0].pid, signal.SIGTERM)
        assert job.wait(120) == [0], job.output()[-3000:]
        job.wait_all_gone(10)
    finally:
        job.close()
    stop = int(job.wait_for(r"exiting at iteration (\d+) \(signal", 1).group(1))
    assert tracker(ckpt) == stop >= 3


@pytest.mark.timeout(120)
def test_exit_duration_saves_and_exits_zero(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, PRETRAIN, *tiny_args(1000, save=ckpt, exit_duration_in_mins=0.001)],
        env=env, capture_output=True, text=True, timeout=100,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exiting at iteration 1 (duration" in out.stdout
    assert tracker(ckpt) == 1
