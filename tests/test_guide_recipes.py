"""The guide's long-context recipes are commands that start: every dry run and every
launch in docs/guide/long-context.md parses, at its world size, through the trainer's own
flags and start-up rules.

The page's bash blocks run in order, as a user pastes them, with stand-ins for python,
torchrun and sbatch that record their arguments and start nothing; a recipe whose flags
drift from the parser, or whose batch no longer divides its data-parallel size, fails
here with the trainer's one-line error.
"""

from __future__ import annotations

import os
import re
import subprocess

from harness.runs import REPO_ROOT

from megatron_weipipe.arguments import parse_config

GUIDE = os.path.join(REPO_ROOT, "docs", "guide", "long-context.md")
RECORD = r'''
record() { n=$((n + 1)); printf '%s\0' "$@" > "$OUT/$(printf %03d $n)"; }
python() { record python "$@"; }
torchrun() { record torchrun "$@"; }
sbatch() { record sbatch "$@"; }
n=0
'''


def _commands(tmp_path) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", open(GUIDE).read(), re.S)
    script = RECORD + "\n".join(blocks)
    out = tmp_path / "argv"
    out.mkdir()
    (tmp_path / "tokenizer.json").write_text("{}")  # start-up checks that it exists; nothing loads it here
    env = dict(os.environ, OUT=str(out), DATA=os.path.join(REPO_ROOT, "data", "sample_text_document"),
               TOKENIZER=str(tmp_path / "tokenizer.json"), CKPT=str(tmp_path / "checkpoints"))
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [open(out / f, "rb").read().decode().split("\0")[:-1] for f in sorted(os.listdir(out))]


def _option(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def _dry_run_flags(argv: list[str]) -> tuple[list[str], int]:
    """pretrain_gpt.py's flags of a ``python -m tools.dry_run`` line, and its world size."""
    own = {"--world-size": 1, "--rank": 1, "--platform": 1, "--attention": 1, "--json": 0, "--explain": 0}
    flags, i = [], 0
    while i < len(argv):
        if argv[i] in own:
            i += 1 + own[argv[i]]
            continue
        flags.append(argv[i])
        i += 1
    return flags, int(_option(argv, "--world-size"))


def test_every_recipe_command_parses_at_its_world_size(tmp_path):
    commands = _commands(tmp_path)
    dry_runs = [c[3:] for c in commands if c[:3] == ["python", "-m", "tools.dry_run"]]
    launches = [c[1:] for c in commands if c[0] == "torchrun"]
    assert len(dry_runs) >= 5 and len(launches) >= 3, commands
    for argv in dry_runs:
        flags, world = _dry_run_flags(argv)
        parse_config(flags, world_size=world)
    for argv in launches:
        script = argv.index("pretrain_gpt.py")
        world = int(_option(argv[:script], "--nproc-per-node")) * int(_option(argv[:script], "--nnodes", 1))
        parse_config(argv[script + 1:], world_size=world)
