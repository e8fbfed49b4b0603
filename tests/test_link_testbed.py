"""Smoke run of the link testbed (python -m tools.simulator_validation.link_testbed): one preset, one short sequence, two batches, one round.

The real path: two rank processes in their own network namespaces on a tc-shaped link,
each pinned to a core, training with the trainer's pretrain(). Checked: the JSON rows of
each batch (keys, positive tokens/s, the byte counts by kind: activations for 1F1B, weights
and gradients for WeiPipe, FSDP2's collectives for the FSDP2 rows), FSDP2's bytes following
its options exactly (per unit and microbatch: an all-gather for the forward and one for the
backward, a reduce-scatter; no reshard drops the second gather, one sync per iteration
all reduce-scatters but one), each rank's in-run calibration in the --save file, and no
namespace of this run left behind. Skipped only where namespaces cannot be made (not root,
no iproute2).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tools.simulator_validation import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_reason = netns.available()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"network namespaces not permitted: {_reason}")


@pytest.mark.timeout(240)
def test_smoke_one_preset_one_sequence(tmp_path):
    saved = tmp_path / "sweep.json"
    names = ("1f1b", "weipipe-interleave", "fsdp", "fsdp-no-reshard-sync-once")
    cmd = [sys.executable, "-m", "tools.simulator_validation.link_testbed", "--presets", "ib-edr", "--seqs", "256",
           "--rounds", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--microbatches", "2", "4",
           "--iters", "2", "--schedules", *names, "--json", "--timeout", "200",
           "--save", str(saved), "--calibrate-repeats", "1"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = p.communicate(timeout=220)
    finally:
        if p.poll() is None:
            p.kill()  # SIGKILL: its atexit cannot run; its namespaces are removed below by pid
            p.wait()
    left = netns.remove_stale()
    assert p.returncode == 0, err[-3000:]
    assert not [n for n in left if re.match(rf"{netns.PREFIX}{p.pid}\D", n)], left
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{netns.PREFIX}{p.pid}h" not in spaces and f"{netns.PREFIX}{p.pid}hub" not in spaces
    rows = {(r["schedule"], r["microbatches"]): r for r in json.loads(out)}
    assert set(rows) == {(n, mb) for n in names for mb in (2, 4)}
    for r in rows.values():
        assert r["preset"] == "ib-edr" and r["seq"] == 256 and r["tokens_per_s"] > 0, r
        assert r["bytes_sent"] == sum(r["bytes_by_kind"].values()) > 0
        assert all(x >= 0 for x in r["idle_s_per_rank"] + r["busy_s_per_rank"]) and min(r["busy_s_per_rank"]) > 0
    for mb in (2, 4):  # 1F1B: each rank sends one [s, b, h] fp32 tensor per microbatch (forward or backward)
        assert rows["1f1b", mb]["bytes_by_kind"]["activations"] == mb * 256 * 32 * 4
        assert "activations" not in rows["weipipe-interleave", mb]["bytes_by_kind"]
        assert rows["weipipe-interleave", mb]["bytes_by_kind"]["weights"] > 0
        assert rows["fsdp", mb]["bytes_by_kind"]["fsdp"] > 0 and "activations" not in rows["fsdp", mb]["bytes_by_kind"]
    # FSDP2 per unit: G microbatches per rank, A a gather, R a reduce-scatter: plain G(2A + R),
    # no reshard and one sync GA + R. So at G = 1 and 2: plain doubles, and both options add one
    # gather per microbatch, which is what plain sends beyond them at G = 1.
    plain = {mb: rows["fsdp", mb]["bytes_by_kind"]["fsdp"] for mb in (2, 4)}
    both = {mb: rows["fsdp-no-reshard-sync-once", mb]["bytes_by_kind"]["fsdp"] for mb in (2, 4)}
    assert plain[4] == 2 * plain[2] and both[4] - both[2] == plain[2] - both[2] > 0
    # both ranks timed the layers of this shape before the runs, on their own cores
    cals = json.loads(saved.read_text())["calibrations"]
    assert list(cals) == ["ib-edr"] and list(cals["ib-edr"]) == ["256"] and len(cals["ib-edr"]["256"]) == 2
    for cal in cals["ib-edr"]["256"]:
        assert cal["shape"]["seq_length"] == 256 and cal["shape"]["hidden_size"] == 32
        assert cal["module"]["layers"] == 1 and cal["module"]["forward"] > 0 and cal["flat"]["backward"] > 0
