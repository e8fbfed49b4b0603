"""A mistyped flag or value costs one line on stderr and exit status 2, from every command
that takes pretrain_gpt.py's flags (pretrain_gpt.py, tools/simulate.py, tools/dry_run.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe.arguments import build_parser

CASES = {
    "unknown flag": (["--hiden-size", "8"], "error: unknown flag --hiden-size (did you mean --hidden-size?)"),
    "unknown flag with =": (["--num-layrs=2"], "error: unknown flag --num-layrs (did you mean --num-layers?)"),
    "bad int": (["--num-layers", "x"], "error: --num-layers: invalid int value: 'x'"),
    "bad choice": (["--attention-backend", "bogus"], "error: --attention-backend: invalid choice: 'bogus'"),
}


def _refusal(parse, argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_flag_is_one_line_naming_it(case, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    extra, expected = CASES[case]
    lines = _refusal(build_parser().parse_args, tiny_gpt_args() + extra, capsys)
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_an_unknown_flag_is_named_before_the_flag_it_hides(capsys, monkeypatch):
    """--hiden-size leaves --hidden-size missing; the typo is what the line names."""
    monkeypatch.delenv("RANK", raising=False)
    lines = _refusal(build_parser().parse_args, ["--hiden-size", "8", "--num-layers", "2"], capsys)
    assert lines == [CASES["unknown flag"][1]]


def test_only_rank_0_prints_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _refusal(build_parser().parse_args, ["--hiden-size", "8"], capsys) == []


def test_help_still_prints_usage(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: pretrain_gpt.py")


def test_simulator_and_dry_run_refuse_the_same_way(capsys, monkeypatch):
    from megatron_weipipe.simulator.cli import main as simulate

    monkeypatch.delenv("RANK", raising=False)
    assert _refusal(simulate, ["--hiden-size", "8"], capsys) == [CASES["unknown flag"][1]]
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    for argv, expected in ((["--world-size", "1", "--hiden-size", "8"], CASES["unknown flag"][1]),
                           (["--num-layers", "2"], "error: the following arguments are required: --world-size")):
        proc = subprocess.run([sys.executable, "-m", "tools.dry_run", *argv], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [expected], proc.stderr[-2000:]
