"""bench/decode.py's pooled figures on hand-made results: speedup and break-even tau per method."""

from __future__ import annotations

import re

import pytest

from deepspec.decoding.engine import GenerationResult, StepRecord
from tests.helpers import load_bench_module


def _decode_module():
    return load_bench_module("decode")


def _result(step_s: float, accepted: int, num_steps: int, total_s: float) -> GenerationResult:
    steps = [StepRecord(num_proposed=accepted, num_accepted=accepted, num_committed=accepted + 1, time_s=step_s,
                        propose_s=step_s / 4, verify_s=step_s / 2)] * num_steps
    return GenerationResult(prompt_len=3, output_ids=[7] * (1 + num_steps * (accepted + 1)), steps=steps,
                            ttft_s=0.01, total_time_s=total_s)


def test_summarise_break_even_tau_and_speedup():
    decode = _decode_module()
    figures = decode.summarise({
        "target-only": [_result(0.040, 0, 10, 0.44)],   # 11 tokens, 40 ms steps
        "speculative": [_result(0.060, 2, 10, 0.62)],   # 31 tokens, 60 ms steps, tau 3
        "ngram": [_result(0.050, 1, 10, 0.51)],         # 21 tokens, 50 ms steps, tau 2
        decode.HF: [GenerationResult(prompt_len=3, output_ids=[7] * 11, total_time_s=0.40)],
    })
    assert figures["target-only"]["break_even_tau"] == pytest.approx(1.0)
    assert figures["speculative"]["break_even_tau"] == pytest.approx(1.5)
    assert figures["ngram"]["break_even_tau"] == pytest.approx(1.25)
    assert figures["speculative"]["tau"] == pytest.approx(3.0)
    assert figures[decode.HF]["break_even_tau"] is None and figures[decode.HF]["tau"] is None
    assert figures["speculative"]["speedup"] == pytest.approx((0.44 / 11) / (0.62 / 31))
    assert figures["ngram"]["propose_ms"] == pytest.approx(12.5)


@pytest.mark.filterwarnings("ignore::UserWarning")  # bf16 on a CPU without bf16 units warns; the check is the same
def test_a_draft_of_the_float32_target_runs_in_bfloat16(tmp_path, capsys):
    """The draft records the fingerprint of the float32 target it was built on; bench/decode in bfloat16
    checks it against the target as loaded, before the decoding cast (it used to refuse the draft).
    A lookup corpus that holds the answer to a benched prompt is said to be one (a memorisation figure)."""
    import json

    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.target.load import load_target

    decode = _decode_module()
    model, tokenizer = load_target("default")
    decode.untrained_draft(model, tokenizer).save_pretrained(tmp_path / "draft")
    prompt = load_benchmark("gsm8k", max_samples=1, seed=0)[0].turns[0]
    prepared = tmp_path / "prepared.jsonl"
    prepared.write_text(json.dumps({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "4"}],
                                    "generated_ids": [None, [19, 20]]}) + "\n")
    decode.main(["--draft", str(tmp_path / "draft"), "--dtype", "bfloat16", "--benchmarks", "gsm8k",
                 "--num-prompts", "1", "--max-new-tokens", "2", "--repeats", "1", "--temperatures", "0",
                 "--baselines", "none", "--lookup-first", "2", "--lookup-num-tokens", "5",
                 "--lookup-corpus", str(prepared), "--seed", "0", "--tree-widths", "0,2",
                 "--output-dir", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "decode_bench.json").read_text())
    assert result["dtype"] == "bfloat16"
    methods = result["settings"]["greedy"]["methods"]
    assert result["lookup_num_tokens"] == 5 and "lookup-first-n2+corpus" in methods
    assert result["tree_widths"] == [0, 2]
    assert {"speculative-tree2", "lookup-first-n2-tree2", "lookup-first-n2-tree2+corpus"} <= set(methods)
    assert result["lookup_corpus"]["prompts_answered"]["gsm8k"]["answered"] == 1
    assert (f"--lookup-corpus ({prepared}) holds the target's own answers to evaluated prompts (gsm8k 1/1)"
            in capsys.readouterr().err)


def test_lookup_num_tokens_with_nothing_to_use_it_is_refused(capsys):
    """--lookup-num-tokens sizes the ngram baseline and the lookups in front of the draft; with neither it
    would be ignored silently, so it is refused (before any model loads)."""
    decode = _decode_module()
    with pytest.raises(SystemExit) as exc:
        decode.main(["--draft", "untrained", "--baselines", "none", "--lookup-num-tokens", "5"])
    assert exc.value.code == 2
    assert "--lookup-num-tokens: nothing uses it" in capsys.readouterr().err


def test_a_lookup_corpus_with_nothing_to_read_it_is_refused(capsys, tmp_path):
    decode = _decode_module()
    for argv, message in ((["--lookup-corpus", str(tmp_path / "p.jsonl")], "bench.lookup_corpus: nothing reads it"),
                          (["--baselines", "ngram+corpus"], "bench.baselines: ngram\\+corpus needs bench.lookup_corpus"),
                          (["--baselines", "ngram+corpus", "--lookup-corpus", str(tmp_path / "p.jsonl")],
                           "p.jsonl is not a file")):
        with pytest.raises(SystemExit) as exc:
            decode.main(["--draft", "untrained", *argv])
        assert exc.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv


def test_bad_tree_widths_are_refused(capsys):
    decode = _decode_module()
    for argv, message in ((["--tree-widths", "-1"], "--tree-widths: expected comma-separated integers >= 0"),
                          (["--tree-widths", "1"], "--tree-widths: 1 adds lookup-first rows only"),
                          (["--tree-widths", "2", "--compile", "on"], "draft trees need the eager target path")):
        with pytest.raises(SystemExit) as exc:
            decode.main(["--draft", "untrained", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv
