"""The Megatron-format log line, validation loss and TensorBoard scalars of a real run."""

import glob
import os
import re
import subprocess
import sys

from harness.runs import REPO_ROOT, tiny_gpt_args


def test_log_line_validation_and_tensorboard(tmp_path):
    tb = tmp_path / "tb"
    argv = tiny_gpt_args(train_iters=4, log_interval=2, eval_interval=2, eval_iters=1, tensorboard_dir=str(tb),
                         split="90,10,0")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if re.search(r"iteration +\d+/ +4 \|", l)]
    assert len(lines) == 2
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "throughput per GPU (TFLOP/s/GPU):",
                  "tokens/s:", "learning rate:", "lm loss:", "grad norm:", "mem (GB):", "sent/rank/iter:"):
        assert field in lines[-1], field
    assert proc.stdout.count("validation loss at iteration") == 2
    assert glob.glob(str(tb / "events.out.tfevents.*"))
