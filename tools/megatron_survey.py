#!/usr/bin/env python
"""Every flag of Megatron-LM's GPT/Llama pretraining scripts, and what it does here.

    python -m tools.megatron_survey --megatron-lm PATH/TO/Megatron-LM [SCRIPT[@REVISION] ...]

PATH is a Megatron-LM git repository (a clone, or a mirror without a work tree). Each
script is read from it at HEAD, or at REVISION for the scripts that live only on a pull
request's branch, and runs under bash with stand-ins for torchrun, nsys and python that
record their arguments and start nothing (an absolute interpreter path such as
``/bin/python`` is read as ``python``). The flags after ``pretrain_gpt.py`` are classified
against this package's parser: ``runs`` (a flag of the typed configs), ``accepted, with its
effect`` / ``accepted, no effect`` / ``refused`` (Megatron-LM flags kept in
megatron_compat.py), or ``unknown``. The output is the table in docs/reference/flags.md
("Megatron-LM's example scripts"); tests/test_megatron_survey.py checks that the table's
last column still says what the parser does.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import fields

# Megatron-LM's GPT / Llama pretraining launch scripts: those of its main branch, then the
# Llama-3 8B bf16 and Llama-3.2 1B scripts of pull requests 1723 and 1794, whose flags are the
# ones users copy (W&B, per-token loss, bf16 gradient reduction, logging).
SCRIPTS = (
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h200_bf16.sh@0c0185b16dc7e98c9f2adfbf476fd52f58894644",
    "examples/llama/train_llama32_1b_h100_fp8.sh@078b84588180387a490981131fb9b9a804a5d30e",
)
# Flags Megatron-LM's long-context documentation names, surveyed beside the scripts'.
LONG_CONTEXT = ("--cp-comm-type", "--hierarchical-context-parallel-sizes", "--recompute-modules",
                "--num-distributed-optimizer-instances", "--overlap-p2p-comm", "--use-cpu-initialization")
RECORD = '#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done >> "$ARGV_OUT"; printf "\\n\\0" >> "$ARGV_OUT"\n'
ABSOLUTE_PYTHON = re.compile(r"(?<![\w/.-])(?:/usr)?(?:/local)?/bin/python3?(?=\s)")

RUNS, HONOURED, NOOP, REFUSED, UNKNOWN = ("runs", "accepted, with its effect", "accepted, no effect",
                                          "refused", "unknown")


def status(flag: str) -> str:
    """What this package's parser does with ``flag``."""
    from megatron_weipipe.arguments import build_parser
    from megatron_weipipe.flags import flag_name, flag_spec
    from megatron_weipipe.megatron_compat import _ACCEPTED, _NOOP, MegatronCompatConfig

    for f in fields(MegatronCompatConfig):
        if flag_name(f) == flag:
            text = flag_spec(f).help
            return NOOP if text.startswith(_NOOP) else HONOURED if text.startswith(_ACCEPTED) else REFUSED
    known = {s for action in build_parser()._actions for s in action.option_strings}
    return RUNS if flag in known else UNKNOWN


def script_text(megatron_lm: str, script: str) -> str:
    """The script's text at its revision (``path@rev``; HEAD without one)."""
    path, _, rev = script.partition("@")
    out = subprocess.run(["git", "-C", megatron_lm, "show", f"{rev or 'HEAD'}:{path}"], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"megatron_survey: {script}: {out.stderr.strip().splitlines()[-1]}")
    return ABSOLUTE_PYTHON.sub("python", out.stdout)


def label(script: str) -> str:
    """The short name in the table: the file name, with the revision's first 10 digits if any."""
    path, _, rev = script.partition("@")
    name = os.path.basename(path).removesuffix(".sh")
    return f"{name}@{rev[:10]}" if rev else name


def script_flags(megatron_lm: str, script: str) -> list[str]:
    """The flags ``script`` passes to pretrain_gpt.py, in order (nothing is started)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("torchrun", "nsys", "python", "python3"):
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write(RECORD)
            os.chmod(path, 0o755)
        open(os.path.join(tmp, "pretrain_gpt.py"), "w").close()  # the scripts check it is there
        with open(os.path.join(tmp, "script.sh"), "w") as f:
            f.write(script_text(megatron_lm, script))
        out = os.path.join(tmp, "argv")
        env = dict(os.environ, PATH=f"{tmp}:{os.environ['PATH']}", ARGV_OUT=out, USE_UV="0")  # no uv wrapper
        subprocess.run(["bash", "script.sh"], cwd=tmp, env=env, capture_output=True, timeout=60)
        argv = open(out).read().split("\0") if os.path.exists(out) else []
    at = [i for i, a in enumerate(argv) if os.path.basename(a) == "pretrain_gpt.py"]
    if not at:
        raise SystemExit(f"megatron_survey: {script} did not reach pretrain_gpt.py")
    rest = argv[at[0] + 1:]
    words = [w for a in rest for w in a.split()]  # some scripts pass "--flag value" as one word
    return list(dict.fromkeys(w for w in words if w.startswith("--")))


def survey(megatron_lm: str, scripts=SCRIPTS) -> dict[str, list[str]]:
    """flag -> the scripts (short names) that pass it, scripts first, then the docs' flags."""
    found: dict[str, list[str]] = {}
    for script in scripts:
        for flag in script_flags(megatron_lm, script):
            found.setdefault(flag, []).append(label(script))
    for flag in LONG_CONTEXT:
        found.setdefault(flag, []).append("long-context docs")
    return found


def table(found: dict[str, list[str]]) -> str:
    rows = ["| flag | used by | here |", "|---|---|---|"]
    rows += [f"| `{flag}` | {', '.join(where)} | {status(flag)} |" for flag, where in sorted(found.items())]
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM git repository (clone or mirror)")
    ap.add_argument("scripts", nargs="*", default=list(SCRIPTS))
    a = ap.parse_args(argv)
    found = survey(a.megatron_lm, a.scripts)
    print(table(found))
    counts: dict[str, int] = {}
    for flag in found:
        counts[status(flag)] = counts.get(status(flag), 0) + 1
    print("\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
