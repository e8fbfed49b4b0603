"""--async-save under SIGKILL and SIGTERM: a save in flight is published only when finished.

Real processes, one per rank, and faults.py's hold: the background writer of one save
waits for a release file, so the signal lands while that save is in flight and training
has gone on past it.

- SIGKILL of every rank while the writer of iteration 6 is held: its writers die with
  the ranks, the tracker stays on iteration 3 (published before), ``--load`` picks it,
  and the resumed run's losses are the killed run's own, digit for digit.
- SIGTERM with --exit-signal-handler while the writer of iteration 2 is held: the next
  save (the exit save, or an interval save on the way) waits for it, iteration 2 is
  published first and the exit iteration last; the run exits 0.
"""

import os
import re
import signal

import pytest

from harness.faults import Job, losses, tiny_args, tracker

COMMON = dict(lr_decay_style="constant", async_save=True)
FAST_WATCHDOG = {"MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"}


@pytest.mark.timeout(240)
def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt, release = str(tmp_path / "ckpt"), str(tmp_path / "never")
    env = {**FAST_WATCHDOG, "MEGATRON_WEIPIPE_TEST_HOLD_ASYNC_WRITE": f"{release}:6"}
    job = Job(2, tiny_args(9, save=ckpt, save_interval=3, **COMMON), env=env, torchrun=False)
    try:
        pids = job.wait_ranks(90)
        job.wait_for(r"rank 0 holding the background write of iteration 6", 120)
        job.wait_for(r"iteration\s+8/", 120)  # training went on past the save in flight
        assert tracker(ckpt) == 3
        assert "iter_0000006.partial" in os.listdir(ckpt)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        job.wait_all_gone(30)  # the held writers died with their ranks
    finally:
        job.close()
    killed = losses(job.output())
    assert "successfully saved checkpoint at iteration       3" in job.output()
    assert tracker(ckpt) == 3

    resumed = Job(2, tiny_args(9, save=ckpt, load=ckpt, save_interval=3, **COMMON), env=FAST_WATCHDOG,
                  torchrun=False)
    try:
        assert resumed.wait(120) == [0, 0], resumed.output()[-3000:]
        resumed.wait_all_gone(10)
    finally:
        resumed.close()
    out = resumed.output()
    assert "loaded checkpoint from" in out and "training from iteration 3" in out
    again = losses(out)
    assert sorted(again) == list(range(4, 10))
    assert {it: again[it] for it in range(4, 9)} == {it: killed[it] for it in range(4, 9)}
    assert tracker(ckpt) == 9
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "iter_0000009",
                                        "latest_checkpointed_iteration.txt"]


@pytest.mark.timeout(180)
def test_sigterm_during_an_async_save_waits_for_it_and_publishes_both(tmp_path):
    ckpt, release = str(tmp_path / "ckpt"), str(tmp_path / "release")
    env = {**FAST_WATCHDOG, "MEGATRON_WEIPIPE_TEST_HOLD_ASYNC_WRITE": f"{release}:2"}
    job = Job(2, tiny_args(1000, save=ckpt, save_interval=2, exit_signal_handler=True, **COMMON), env=env,
              torchrun=False)
    try:
        pids = job.wait_ranks(90)
        job.wait_for(r"rank 0 holding the background write of iteration 2", 120)
        os.kill(pids[1], signal.SIGTERM)
        job.wait_for(r"waiting for the async checkpoint save of iteration 2 before the next save", 60)
        assert tracker(ckpt) is None  # nothing published while the writer is held
        open(release, "w").close()
        assert job.wait(120) == [0, 0], job.output()[-3000:]
        job.wait_all_gone(10)
    finally:
        job.close()
    out = job.output()
    stop = int(job.wait_for(r"exiting at iteration (\d+) \(signal", 1).group(1))
    assert stop > 2
    # Iteration 2 first (the saves after it waited for it), the exit iteration last, each published once.
    published = [int(x) for x in re.findall(r"successfully saved checkpoint at iteration\s+(\d+)", out)]
    assert published[0] == 2 and published[-1] == stop and published == sorted(set(published)), out[-3000:]
    assert out.index("successfully saved checkpoint at iteration       2") < out.index(
        f"started an async checkpoint save at iteration {stop:7d}") < out.index(
        f"successfully saved checkpoint at iteration {stop:7d}")
    assert tracker(ckpt) == stop
    assert sorted(os.listdir(ckpt)) == [f"iter_{i:07d}" for i in published] + ["latest_checkpointed_iteration.txt"]
