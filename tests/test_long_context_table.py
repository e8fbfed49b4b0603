"""tools/long_context_table.py: the bisection on known monotone functions, the settings'
flags, and one real (tiny) dry-run row."""

import pytest

from tools import long_context_table as lct


@pytest.mark.parametrize("limit_fit, start", [(5000, 1024), (5000, 65536), (4096, 4096), (300000, 4096)])
def test_bisection_finds_the_longest_on_the_grid(limit_fit, start):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit_fit

    ok, bad, trace = lct.bisect_longest(fits, start, refine=8)
    assert ok <= limit_fit < bad
    # the bracket is one grid step (lower power of two / 8) wide, and every probe was recorded
    lower = 1 << (ok.bit_length() - 1)
    assert bad - ok <= max(1, lower // 8)
    assert trace == [(n, n <= limit_fit) for n in calls]
    assert len(set(calls)) == len(calls)


def test_bisection_with_nothing_fitting_and_everything_fitting():
    ok, bad, trace = lct.bisect_longest(lambda n: False, 1024)
    assert ok == 0 and bad == 64 and len(trace) == 5  # halves to start / 16, then gives up
    ok, bad, _ = lct.bisect_longest(lambda n: True, 1024, limit=8192)
    assert (ok, bad) == (8192, None)


def test_settings_carry_the_stated_flags():
    flags, world, _ = lct.headline_rows("dist-opt", 65536)["2m"][1:] + (None,)
    assert world == 4
    joined = " ".join(flags)
    for f in ("--context-parallel-size 4", "--fpdt-chunk-size 65536", "--fpdt-offload", "--offload-layer-inputs",
              "--recompute-granularity full", "--use-distributed-optimizer", "--seq-length 2097152",
              "--num-query-groups 8", "--ffn-hidden-size 14336", "--vocab-size 128256"):
        assert f in joined
    rows = lct.headline_rows("fsdp2", 65536)
    fsdp = rows["4m"][1]
    assert "--use-torch-fsdp2" in fsdp and "--bf16" in fsdp and "--use-distributed-optimizer" not in fsdp
    _, one, world = rows["1m-1gpu"]
    joined = " ".join(one)
    assert world == 1 and "--optimizer-cpu-offload" in one and "--use-torch-fsdp2" in one
    assert "--seq-length 1048576" in joined and "--fpdt-chunk-size 16384" in joined and "--offload-layer-inputs" in one
    _, big, world = rows["16m"]
    joined = " ".join(big)
    assert world == 32 and "--context-parallel-size 32" in joined and "--fpdt-chunk-size 262144" in joined
    flags, world, att = lct.small_setting("plain+flash", 4096)
    assert world == 1 and att == "flash" and "--context-parallel-size" not in flags
    flags, world, att = lct.small_setting("fpdt+offload", 4096)
    assert world == 2 and att == "local" and "--offload-layer-inputs" in flags and "512" in flags


def test_which_limit_stops_a_row():
    # a rank's host budget is its share of one 2 TB node: the whole node for one rank, 250 GB from 8 on
    assert lct.host_budget(1) == 2e12 and lct.host_budget(4) == 5e11 and lct.host_budget(32) == 2.5e11
    r = {"world": 8, "peak_accelerator_bytes": 70e9, "host_bytes": 250e9}
    assert lct.stopped_by(r, 80e9) == "none"
    assert lct.stopped_by(dict(r, host_bytes=250e9 + 1), 80e9) == "host"
    assert lct.stopped_by(dict(r, world=1, host_bytes=476e9), 80e9) == "none"
    assert lct.stopped_by(dict(r, world=1, host_bytes=476e9), 80e9, host=250e9) == "host"
    assert lct.stopped_by(dict(r, peak_accelerator_bytes=81e9, host_bytes=3e12), 80e9) == "device and host"


def test_one_real_dry_run_row():
    flags, world, att = lct.small_setting("fpdt+offload", 1024)
    r = lct.dry_run(flags, world, att, timeout=600)
    assert r["world"] == 2 and r["command"].startswith("python -m tools.dry_run ")
    assert r["host_bytes"] > 0  # the layer inputs and FPDT chunks went to the host pools
    # h=256, 4 layers, byte-level vocab padded to 384: parameters bf16 on the accelerator
    assert 0 < r["categories"]["parameters"] < 20e6 < r["peak_accelerator_bytes"] < 2e9
    line, cmd = lct.row_lines("tiny", r, budget=2e9)
    assert "| yes (largest:" in line and "| none |" in line and "4 such jobs" in line and cmd.strip().startswith("`python -m tools.dry_run")
    assert "| no (largest:" in lct.row_lines("tiny", r, budget=r["peak_accelerator_bytes"] - 1)[0]
