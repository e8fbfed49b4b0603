"""tools/schedule_timeline.py prints a tick table with the bubble fraction and draws a PNG
for each of the five schedules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
TOOL = ["-m", "tools.schedule_timeline"]  # run from ROOT


@pytest.fixture(scope="module")
def tool():
    from tools import schedule_timeline

    return vars(schedule_timeline)


@pytest.mark.parametrize("name,bubble", [
    ("1f1b", "0.1579"),
    ("interleaved", "0.0857"),
    ("weipipe-naive", "0.2381"),
    ("weipipe-interleave", "0.1111"),
    ("weipipe-zb", "0.0588"),
])
def test_text_and_png_for_every_schedule(tool, tmp_path, capsys, name, bubble):
    png = tmp_path / f"{name}.png"
    assert tool["main"](["--schedule", name, "-P", "4", "-G", "4", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"bubble fraction {bubble}" in out
    assert "| tick | r0 | r1 | r2 | r3 |" in out
    assert png.stat().st_size > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_design_note_table_and_rejects_bad_sizes():
    run = subprocess.run([sys.executable, *TOOL, "--schedule", "weipipe-interleave", "-P", "4", "-G", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "| 4 | B0.s3+F1.s0 | F0.s3 | F0.s2 | F0.s1 |" in run.stdout
    assert "ticks 15; idle ticks per rank [3, 3, 3, 3]" in run.stdout
    bad = subprocess.run([sys.executable, *TOOL, "--schedule", "interleaved", "-P", "4", "-G", "1", "-N", "3"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("schedule_timeline: interleaved 1F1B needs the number of microbatches (3) "
                                  "to be a multiple of P=4")
