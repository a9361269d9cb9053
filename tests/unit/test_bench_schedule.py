"""bench/schedule.py's prompt sets and its speedup plot."""

from __future__ import annotations

import json

from tests.helpers import load_bench_module


def test_prompt_sets_read_turns_files_and_cap_them(tmp_path, monkeypatch):
    bench = load_bench_module("schedule")
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"turns": [t, "later"]}) + "\n" for t in ["ab", "abc", "abcd"]))
    seen = []
    monkeypatch.setattr(bench, "render_prompt", lambda tok, messages: seen.append(messages) or [len(seen)])
    sets = bench.prompt_sets([f"mine={rows}"], tokenizer=None, num_prompts=2)
    assert sets == {"mine": [[1], [2]]}
    assert seen == [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "abc"}]]  # first turns only


def test_plot_writes_a_png(tmp_path):
    bench = load_bench_module("schedule")
    results = {s: {m: {"speedup": x} for m, x in [("target-only", 1.0), ("chain-auto", 1.3)]} for s in ["a", "b"]}
    bench.plot(results, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
