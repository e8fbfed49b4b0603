#!/usr/bin/env python
"""Print the README's table of pretrain_gpt.py flags, generated from the typed configs.

    python tools/flags_table.py

tests/test_flags.py checks that README.md holds exactly this table, so the flags have one
home (the config dataclasses) and the README cannot drift from them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_weipipe.arguments import SECTIONS  # noqa: E402
from megatron_weipipe.flags import flag_fields, flag_name  # noqa: E402


def flags_table() -> str:
    rows = ["| group | flags |", "|---|---|"]
    for _, cls, title in SECTIONS:
        names = []
        for f, spec, _ in flag_fields(cls):
            choices = f" {{{','.join(map(str, spec.choices))}}}" if spec.choices else ""
            names.append(flag_name(f) + choices)
        rows.append(f"| {title} | `{' '.join(names)}` |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(flags_table())
