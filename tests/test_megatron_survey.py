"""docs/reference/flags.md's survey of Megatron-LM's example scripts says what each flag
does here now: every row's last column is what tools/megatron_survey.py's classification of
this package's parser gives (the table was made by that tool from a Megatron-LM checkout;
this test needs none)."""

from __future__ import annotations

import os
import re

from harness.runs import REPO_ROOT

from tools.megatron_survey import RUNS, UNKNOWN, status

FLAGS_DOC = os.path.join(REPO_ROOT, "docs", "reference", "flags.md")
HEADING = "## Megatron-LM's example scripts"


def _rows() -> list[tuple[str, str]]:
    text = open(FLAGS_DOC).read()
    section = text[text.index(HEADING):]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"^\| `(--[a-z0-9-]+)` \| [^|]+ \| ([^|]+) \|$", section, re.M)


def test_survey_rows_say_what_the_parser_does():
    rows = _rows()
    assert len(rows) >= 90, len(rows)
    wrong = [f"{flag}: the page says {here.strip()!r}, the parser {status(flag)!r}"
             for flag, here in rows if status(flag) != here.strip()]
    assert not wrong, "rerun python -m tools.megatron_survey: " + "; ".join(wrong)


def test_the_classification_tells_flags_apart():
    assert status("--num-layers") == RUNS
    assert status("--no-such-flag-anywhere") == UNKNOWN
