"""The CPU image built from the repository's Dockerfile and run for real (tools/docker_smoke.sh):
the quickstart inside two containers sharing a checkpoint volume (stopped at 25, resumed to 50)
gives the losses of the same quickstart run outside any container."""

import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from harness.runs import REPO_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

BASE_IMAGE = "megatron-weipipe-base:bookworm"
SMOKE_DEADLINE_S = 2100
OUTSIDE_DEADLINE_S = 1200
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def _answers(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _missing():
    """Why the image cannot be built here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (tools/install_docker.sh installs docker.io and debootstrap)"
    if shutil.which("dockerd") is None and not _answers("docker", "info"):
        return "no dockerd and no running docker daemon (tools/install_docker.sh)"
    if shutil.which("debootstrap") is None and not _answers("docker", "image", "inspect", BASE_IMAGE):
        return f"no debootstrap to make {BASE_IMAGE} (tools/install_docker.sh)"
    return None


def _start(cmd, log, env=None):
    """A process in its own session, so that a deadline can stop it and everything it started."""
    out = open(log, "w")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), out


def _finish(proc, out, deadline_s):
    try:
        return proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args} ran past {deadline_s} s")
    finally:
        if proc.poll() is None:  # deadline, or the test itself was stopped
            os.killpg(proc.pid, signal.SIGTERM)  # the smoke script's trap stops what it started
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.close()


def _losses(*logs):
    train, valid = {}, {}
    for log in logs:
        text = open(log).read()
        train.update((int(i), float(v)) for i, v in _ITER.findall(text))
        valid.update((int(i), float(v)) for i, v in _VALID.findall(text))
    return train, valid


def _facts(path):
    return dict(line.split("=", 1) for line in open(path).read().split("\n") if "=" in line)


def test_cpu_image_builds_runs_resumes_and_matches_the_run_outside(tmp_path):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "smoke"
    # The run outside (the reference) overlaps the image build, which mostly waits on downloads.
    env = dict(os.environ, CKPT=str(tmp_path / "outside_ckpt"), OMP_NUM_THREADS="1")
    outside = _start(["bash", "examples/cpu_quickstart.sh"], tmp_path / "outside.log", env=env)
    smoke = _start(["bash", "tools/docker_smoke.sh", str(out)], tmp_path / "smoke.log")
    smoke_rc = _finish(*smoke, SMOKE_DEADLINE_S)
    outside_rc = _finish(*outside, OUTSIDE_DEADLINE_S)
    smoke_log = (tmp_path / "smoke.log").read_text()
    assert smoke_rc == 0, smoke_log[-3000:]
    assert outside_rc == 0, (tmp_path / "outside.log").read_text()[-3000:]

    facts = _facts(out / "facts.env")
    assert facts["TORCH"] == torch.__version__, "the image must hold the torch the reference ran with"
    inside_train, inside_valid = _losses(out / "quickstart_first.log", out / "quickstart_resumed.log")
    first_train, _ = _losses(out / "quickstart_first.log")
    resumed_train, _ = _losses(out / "quickstart_resumed.log")
    assert sorted(first_train) == [5, 10, 15, 20, 25] and sorted(resumed_train) == [30, 35, 40, 45, 50]
    outside_train, outside_valid = _losses(tmp_path / "outside.log")
    assert sorted(outside_train) == list(range(5, 51, 5)) and sorted(outside_valid) == [25, 50]
    assert sorted(inside_valid) == [25, 50]
    # Same torch wheel, same seed and data, one thread per rank: equal to the printed digits;
    # 1e-5 relative leaves room only for the last printed digit.
    for it, loss in outside_train.items():
        assert inside_train[it] == pytest.approx(loss, rel=1e-5), (it, inside_train[it], loss)
    for it, loss in outside_valid.items():
        assert inside_valid[it] == pytest.approx(loss, rel=1e-5), (it, inside_valid[it], loss)
    print(f"\nbuild {facts['BUILD_SECONDS']} s, image {int(facts['IMAGE_BYTES']) // 10**6} MB")
    for it in sorted(outside_train):
        print(f"iteration {it:3d}: lm loss inside {inside_train[it]:.6f} outside {outside_train[it]:.6f}")
