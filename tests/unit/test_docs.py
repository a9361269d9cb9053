"""docs/semantics.md agrees with the code where a new user reads it first: unique section titles (a
reference like "see Target cache" names one place) and the defaults it states for prepare's flags."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

from deepspec.data.prepare import PrepareConfig

SEMANTICS = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


def test_section_titles_are_unique():
    # "Target cache" and "Target cache (issue 3)" are one title to a reader: the issue tag is not a name
    titles = [re.sub(r"\s*\(issue \d+\)$", "", line.strip())
              for line in SEMANTICS.read_text(encoding="utf-8").splitlines() if re.match(r"##+ ", line)]
    assert titles and [t for t, n in Counter(titles).items() if n > 1] == []


def test_stated_prepare_defaults_match_the_config():
    text = " ".join(SEMANTICS.read_text(encoding="utf-8").split())  # a statement may wrap across lines
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}
    stated = re.findall(r"`--(max-turns)`, default (\w+)", text)
    assert stated  # the doc states it: check it
    for flag, value in stated:
        default = defaults[flag.replace("-", "_")]
        assert value == ("none" if default is None else str(default)), f"--{flag}: doc says {value}, code {default}"
