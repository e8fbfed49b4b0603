#!/usr/bin/env python
"""Print docs/reference/flags.md's table of pretrain_gpt.py flags, generated from the typed configs.

    python -m tools.flags_table

tests/test_flags.py checks that docs/reference/flags.md holds exactly this table, so the flags have one
home (the config dataclasses) and the page cannot drift from them.
"""

from __future__ import annotations

from megatron_weipipe.arguments import SECTIONS
from megatron_weipipe.flags import flag_fields, flag_name


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
