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


def test_run_fastest_keeps_each_engines_fastest_run_from_one_starting_state():
    """Each repeat runs from the state the engines started with, in ABBA order; the fastest run is kept and each
    engine carries on from the state that run left; one repeat copies nothing."""
    from types import SimpleNamespace

    import pytest

    from deepspec.eval.run import run_fastest

    def engine():
        return SimpleNamespace(scheduler={"seen": []}, proposer=SimpleNamespace(steps_from_draft=0))

    engines = {"a": engine(), "b": engine()}
    seconds = {"a": iter([3.0, 1.0, 2.0]), "b": iter([1.0, 2.0, 3.0])}
    calls, starts = [], []

    def run_once(name, eng):
        starts.append((name, list(eng.scheduler["seen"]), eng.proposer.steps_from_draft))
        calls.append(name)
        eng.scheduler["seen"].append(len(calls))
        eng.proposer.steps_from_draft += 1
        s = next(seconds[name])
        return s, (name, s)

    kept = run_fastest(list(engines.items()), run_once, repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert all(seen == [] and steps == 0 for _, seen, steps in starts)  # every repeat from the starting state
    assert kept == {"a": ("a", 1.0), "b": ("b", 1.0)}
    assert engines["a"].scheduler == {"seen": [4]} and engines["b"].scheduler == {"seen": [2]}  # the kept run's state
    assert engines["a"].proposer.steps_from_draft == 1

    once = engine()
    assert run_fastest([("c", once)], lambda n, e: (e.scheduler["seen"].append(0) or 5.0, n), repeats=1) == {"c": "c"}
    assert once.scheduler == {"seen": [0]}
    with pytest.raises(ValueError, match="repeats"):
        run_fastest([("c", once)], run_once, repeats=0)


def test_shared_text_figures_keep_only_the_prompts_every_method_decodes_alike():
    from types import SimpleNamespace as NS

    mod = load_bench_module("schedule")

    def result(out, seconds, committed):
        return NS(output_ids=out, total_time_s=seconds, num_new_tokens=len(out),
                  steps=[NS(num_committed=c) for c in committed])

    runs = {
        "target-only": [result([1, 2, 3, 4], 4.0, [1, 1, 1, 1]), result([5, 6], 2.0, [1, 1])],
        "a": [result([1, 2, 3, 4], 2.0, [2, 2]), result([5, 7], 0.5, [2])],  # parts on the second prompt
        "b": [result([1, 2, 3, 4], 1.0, [4]), result([5, 6], 1.0, [1, 1])],
    }
    figures = mod.shared_text_figures(runs)
    assert {n: f["num_shared"] for n, f in figures.items()} == {"target-only": 1, "a": 1, "b": 1}
    assert figures["a"]["tau_shared"] == 2.0 and figures["b"]["tau_shared"] == 4.0  # the second prompt left out
    assert figures["a"]["speedup_shared"] == 2.0 and figures["b"]["speedup_shared"] == 4.0
    runs["b"][0] = result([1, 2, 9, 9], 1.0, [4])  # now no prompt is shared
    assert all(f["tau_shared"] is None and f["speedup_shared"] is None for f in mod.shared_text_figures(runs).values())
