"""SIGKILL in the middle of a save: the previous checkpoint stays the one --load picks.

The test hook pauses the save of iteration 6 after every shard is written and before
the checkpoint is published, the moment where a complete-looking directory exists but
must not be used. The rank is killed there; the next run resumes from iteration 3,
removes the leftover directory and saves iteration 6 again.
"""

import os
import signal

import pytest

from harness.faults import Job, tiny_args, tracker


@pytest.mark.timeout(240)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    env = {"MEGATRON_WEIPIPE_TEST_SLOW_SAVE": "60:6", "MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"}
    job = Job(2, tiny_args(9, save=ckpt, save_interval=3), env=env)
    try:
        pids = job.wait_ranks(90)
        job.wait_for(r"rank 0 pausing .* save of iteration 6", 120)
        assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006.partial", "latest_checkpointed_iteration.txt"]
        os.kill(pids[0], signal.SIGKILL)
        job.wait_all_gone(40)
        assert job.wait(10) != [0]
    finally:
        job.close()
    assert tracker(ckpt) == 3
    # No resident helper (megatron-core's writer would start a multiprocessing Manager).
    assert not [c for c in job.cmdlines.values() if "spawn_main" in c], job.cmdlines

    resumed = Job(2, tiny_args(9, save=ckpt, load=ckpt, save_interval=3), torchrun=False)
    try:
        assert resumed.wait(120) == [0, 0], resumed.output()[-3000:]
        resumed.wait_all_gone(10)
    finally:
        resumed.close()
    out = resumed.output()
    assert "loaded checkpoint from" in out and "at iteration 3" in out
    assert "training from iteration 3" in out
    assert "iteration        9/       9" in out
    assert tracker(ckpt) == 9
    assert sorted(os.listdir(ckpt)) == [
        "iter_0000003", "iter_0000006", "iter_0000009", "latest_checkpointed_iteration.txt"
    ]
