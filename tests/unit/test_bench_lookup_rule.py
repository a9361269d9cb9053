"""bench/lookup_rule.py's rules on hand-made contexts: where each copies from and where its copy stops."""

from __future__ import annotations

from deepspec.algorithms.ngram.proposer import ngram_proposal
from tests.helpers import load_bench_module


def test_the_compared_rules():
    rules = load_bench_module("lookup_rule").RULES
    assert rules["recent-continued"] is ngram_proposal
    ctx = [1, 7, 8, 2, 7, 8, 9, 7, 8]  # (7, 8) at 1..2 and 4..5
    want = {"recent-cut": [9, 7, 8], "leftmost-cut": [2, 7, 8, 9, 7],
            "leftmost-continued": [2, 7, 8, 9, 7], "recent-continued": [9, 7, 8, 9, 7]}
    for name, rule in rules.items():
        assert rule(ctx, ngram_max=2, ngram_min=1, num_tokens=5) == want[name], name
    run = [5, 4, 4]  # a run that only started: every occurrence of (4) overlaps the end
    want = {"recent-cut": [4], "leftmost-cut": [4], "leftmost-continued": [4] * 4, "recent-continued": [4] * 4}
    for name, rule in rules.items():
        assert rule(run, ngram_max=3, ngram_min=1, num_tokens=4) == want[name], name
        assert rule([1, 2, 3], ngram_max=3, ngram_min=1, num_tokens=4) == [], name
