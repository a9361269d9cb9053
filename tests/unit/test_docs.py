"""docs/design/ agrees with the code where a reader follows it: section titles unique across the pages (a
reference like "see Target cache" names one place), every citation of a page and section in the package,
the tests and bench names one that exists, and the defaults it states for prepare's flags."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

from deepspec.data.prepare import PrepareConfig

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design"


def _titles(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text(encoding="utf-8").splitlines() if re.match(r"##+ ", line)]


def test_section_titles_are_unique():
    titles = [t for page in sorted(DESIGN.glob("*.md")) for t in _titles(page)]
    assert titles and [t for t, n in Counter(titles).items() if n > 1] == []


def test_citations_name_existing_pages_and_sections():
    """``docs/design/<page>.md, "<section>"`` in a docstring or comment (wrapped lines joined) names a page
    that exists and, when given, one of its section titles."""
    cited = 0
    for folder in ("deepspec", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text(encoding="utf-8"))
            for page, section in re.findall(r'docs/design/([\w-]+\.md)`?(?:,? "([^"]+)")?', text):
                cited += 1
                assert (DESIGN / page).is_file(), f"{path}: cites docs/design/{page}, which does not exist"
                if section:
                    assert section in _titles(DESIGN / page), f"{path}: no section {section!r} in docs/design/{page}"
    assert cited > 20  # the package cites its rules


def test_stated_prepare_defaults_match_the_config():
    text = " ".join((DESIGN / "data.md").read_text(encoding="utf-8").split())  # a statement may wrap across lines
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}
    stated = re.findall(r"`--(max-turns)`, default (\w+)", text)
    assert stated  # the doc states it: check it
    for flag, value in stated:
        default = defaults[flag.replace("-", "_")]
        assert value == ("none" if default is None else str(default)), f"--{flag}: doc says {value}, code {default}"
