"""A draft is evaluated only against the target it was made for.

Target A (4 layers), B (A's shape, other weights: a fine-tuned target) and C (6 layers). Every saved
draft (DSpark, DFlash, Eagle3, and the original-layout export) records A's fingerprint and shape;
evaluating it against C is refused whatever the flags, against B refused unless
``allow_target_mismatch`` (then recorded in the report). A saved config missing a field that changes
the forward pass (``target_layer_ids``) is a ValueError naming it, not a raw TypeError.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.algorithms.registry import check_draft_target, load_draft
from deepspec.target.load import target_fingerprint
from tests.helpers import byte_level_tokenizer

try:
    from tests.unit.test_chat import CHATML
except ImportError:  # pytest run from another folder
    from test_chat import CHATML

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER_IDS = [0, 1]


def _tok():
    return byte_level_tokenizer(CHATML, extra_specials=("<repo_name>",))


def _target(tok, *, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, targets A/B/C, {algorithm: saved draft folder made for A})."""
    from deepspec.algorithms.dspark.original import save_original_dspark
    from deepspec.train.config import TrainConfig
    from deepspec.train.draft import build_draft

    tok = _tok()
    targets = {"A": _target(tok, layers=4, seed=0), "B": _target(tok, layers=4, seed=1),
               "C": _target(tok, layers=6, seed=0)}
    root = tmp_path_factory.mktemp("drafts")
    folders = {}
    for algorithm in ("dspark", "dflash", "eagle3"):
        cfg = TrainConfig(output_dir=str(root), cache_dir=str(root), algorithm=algorithm, markov_rank=8,
                          mask_token="<repo_name>")
        model = build_draft(targets["A"], tok, cfg, LAYER_IDS)
        folders[algorithm] = model.save_pretrained(root / algorithm)
        if algorithm == "dspark":  # the original layout holds the target family's own layers only
            cfg.draft_backbone = "target"
            folders["original"] = save_original_dspark(build_draft(targets["A"], tok, cfg, LAYER_IDS), root / "original")
    return tok, targets, folders


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "original"])
def test_every_saved_draft_records_its_target(setup, kind):
    tok, targets, folders = setup
    saved = json.loads((folders[kind] / "config.json").read_text())
    fields = saved.get("draft_config") or saved.get("eagle3_config") or saved
    want = target_fingerprint(targets["A"])
    assert fields["target_fingerprint"] == want
    if kind == "original":
        assert (fields["num_target_layers"], fields["hidden_size"], fields["vocab_size"]) == (4, 32, len(tok))
    else:
        assert (fields["target_num_hidden_layers"], fields["target_hidden_size"], fields["vocab_size"]) == \
            (4, 32, len(tok))
    _, draft = load_draft(folders[kind], target_model=targets["A"])
    assert draft.config.target_fingerprint == want
    assert check_draft_target(kind, draft.config, targets["A"])["status"] == "match"


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "original"])
def test_another_target_shape_is_refused_naming_both(setup, kind):
    _, targets, folders = setup
    message = (r"key 'num_target_layers': expected 6 \(the target's\), received 4" if kind == "original" else
               r"made for another target: target_num_hidden_layers=4 \(target num_hidden_layers=6\)")
    with pytest.raises(ValueError, match=message):
        load_draft(folders[kind], target_model=targets["C"], allow_target_mismatch=True)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_same_shape_other_weights_is_refused_unless_allowed(setup, kind):
    _, targets, folders = setup
    fa, fb = target_fingerprint(targets["A"]), target_fingerprint(targets["B"])
    with pytest.raises(ValueError, match=rf"trained against target fingerprint {fa[:16]}\.\.\., this target is "
                                         rf"{fb[:16]}\.\.\..*--allow-target-mismatch"):
        load_draft(folders[kind], target_model=targets["B"])
    _, draft = load_draft(folders[kind], target_model=targets["B"], allow_target_mismatch=True)
    record = check_draft_target(kind, draft.config, targets["B"], allow_mismatch=True)
    assert record["status"] == "mismatch_allowed" and record["draft_target_fingerprint"] == fa
    assert record["target_fingerprint"] == fb and "WARNING" in record["message"]


def test_eval_stage_refuses_or_reports_a_target_mismatch(setup, tmp_path, capsys, monkeypatch):
    from deepspec.eval.stage import EvalConfig, run_eval_stage

    tok, targets, folders = setup
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    kw = dict(draft=[str(folders["dspark"]), str(folders["eagle3"])], benchmarks=["gsm8k"],
              benchmark_files=[f"gsm8k={bench}"], num_prompts=1, max_new_tokens=4, compare_hf_generate=False)
    with pytest.raises(ValueError, match="--allow-target-mismatch"):
        run_eval_stage(EvalConfig(output_dir=str(tmp_path / "refused"), **kw), target_model=targets["B"],
                       tokenizer=tok)
    with pytest.raises(ValueError, match="made for another target"):
        run_eval_stage(EvalConfig(output_dir=str(tmp_path / "c"), allow_target_mismatch=True, **kw),
                       target_model=targets["C"], tokenizer=tok)
    capsys.readouterr()
    res = run_eval_stage(EvalConfig(output_dir=str(tmp_path / "allowed"), allow_target_mismatch=True, **kw),
                         target_model=targets["B"], tokenizer=tok)
    assert "WARNING: draft" in capsys.readouterr().err
    checks = res["config"]["target_check"]
    assert len(checks) == 2 and {c["status"] for c in checks.values()} == {"mismatch_allowed"}
    assert res["config"]["target_fingerprint"] == target_fingerprint(targets["B"])
    assert "TRAINED AGAINST ANOTHER TARGET" in (tmp_path / "allowed" / "eval_report.md").read_text()
    res = run_eval_stage(EvalConfig(output_dir=str(tmp_path / "ok"), **kw), target_model=targets["A"], tokenizer=tok)
    assert {c["status"] for c in res["config"]["target_check"].values()} == {"match"}
    assert res["config"]["device"] == "cpu" and " on cpu; torch " in (tmp_path / "ok" / "eval_report.md").read_text()
    # a draft named by a bare relative folder is labelled by its parent and name, never "dspark:/dspark"
    monkeypatch.chdir(folders["dspark"].parent)
    res = run_eval_stage(EvalConfig(output_dir=str(tmp_path / "rel"), **{**kw, "draft": ["dspark"]}),
                         target_model=targets["A"], tokenizer=tok)
    assert list(res["config"]["target_check"]) == [f"dspark:{folders['dspark'].parent.name}/dspark"]


@pytest.mark.parametrize("kind,section", [("dspark", "draft_config"), ("eagle3", "eagle3_config")])
@pytest.mark.parametrize("key", ["target_layer_ids", "rms_norm_eps", "rope_parameters"])
def test_a_missing_forward_field_is_an_error_naming_it(setup, tmp_path, kind, section, key):
    import shutil

    _, _, folders = setup
    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    saved = json.loads((folder / "config.json").read_text())
    del saved[section][key]
    (folder / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"from_dict: missing keys \['{key}'\]; they change the draft's forward"):
        load_draft(folder)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_truncated_or_missing_weights_file_is_an_error_naming_it(setup, tmp_path, kind):
    import shutil

    _, _, folders = setup
    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # an interrupted copy
    with pytest.raises(ValueError, match=r"model\.safetensors: unreadable .*Copy the draft folder again"):
        load_draft(folder)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors; pass a draft folder written by `deepspec train`"):
        load_draft(folder)


def test_metadata_and_training_knobs_may_be_absent(setup, tmp_path):
    """Drafts saved before the target fingerprint (or markov_head_type) existed still load; the
    fingerprint is then reported as not recorded."""
    import shutil

    _, targets, folders = setup
    folder = tmp_path / "old"
    shutil.copytree(folders["dspark"], folder)
    saved = json.loads((folder / "config.json").read_text())
    for key in ("target_fingerprint", "markov_head_type", "ce_weight"):
        del saved["draft_config"][key]
    (folder / "config.json").write_text(json.dumps(saved))
    _, draft = load_draft(folder, target_model=targets["B"])  # shape checked, fingerprint unknown
    assert draft.config.target_fingerprint is None and draft.config.markov_head_type == "vanilla"
    assert check_draft_target("old", draft.config, targets["B"])["status"] == "not_recorded"


def test_original_layout_missing_norm_eps_is_an_error(setup, tmp_path):
    import shutil

    _, _, folders = setup
    folder = tmp_path / "orig"
    shutil.copytree(folders["original"], folder)
    saved = json.loads((folder / "config.json").read_text())
    del saved["rms_norm_eps"]
    (folder / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="key 'rms_norm_eps': expected a value"):
        load_draft(folder)


def test_eval_lookup_first_adds_a_row_per_draft_with_its_lookup_share(setup, tmp_path):
    from deepspec.eval.stage import EvalConfig, run_eval_stage

    tok, targets, folders = setup
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"question": "1 + 1 = 1 + 1 = 1 + 1 = ?", "answer": "#### 2"}) + "\n")
    res = run_eval_stage(EvalConfig(draft=[str(folders["dspark"]), str(folders["eagle3"])], benchmarks=["gsm8k"],
                                    benchmark_files=[f"gsm8k={bench}"], num_prompts=1, max_new_tokens=24,
                                    compare_hf_generate=False, lookup_first=1, dtype="float32",
                                    num_draft_tokens=2, lookup_num_tokens=5, output_dir=str(tmp_path / "e")),
                         target_model=targets["A"], tokenizer=tok)
    names = list(res["config"]["proposers"])
    drafts = [n for n in names if n.startswith(("dspark:", "eagle3:")) and not n.endswith("+lookup")]
    assert names == [*drafts, *(f"{n}+lookup" for n in drafts), "ngram"]
    for n in drafts:
        info = res["config"]["proposers"][f"{n}+lookup"]
        assert info["type"] == "LookupFirstProposer" and (info["ngram_max"], info["ngram_min"]) == (3, 1)
        # the drafts are capped at num_draft_tokens; an explicit lookup_num_tokens is not
        assert (info["max_proposal_len"], res["config"]["proposers"][n]["max_proposal_len"]) == (5, 2)
        assert (info["lookup_num_tokens"], info["draft_max_proposal_len"]) == (5, 2)
        assert info["dtype"] == "float32"
        fig = res["benchmarks"]["gsm8k"][f"{n}+lookup"]
        assert 0.0 < fig["frac_steps_from_lookup"] <= 1.0  # the prompt repeats itself: the lookup proposes
        assert fig["frac_identical_to_baseline"] == 1.0
        assert "frac_steps_from_lookup" not in res["benchmarks"]["gsm8k"][n]
    assert res["config"]["proposers"]["ngram"]["max_proposal_len"] == 2  # the first draft's K after the cap
    with pytest.raises(ValueError, match="eval.lookup_first"):
        EvalConfig(draft=["x"], output_dir="o", lookup_first=0)
    with pytest.raises(ValueError, match="eval.lookup_num_tokens"):
        EvalConfig(draft=["x"], output_dir="o", lookup_first=2, lookup_num_tokens=0)
    with pytest.raises(ValueError, match="eval.lookup_num_tokens: set without eval.lookup_first"):
        EvalConfig(draft=["x"], output_dir="o", lookup_num_tokens=7)


def test_eval_with_a_confidence_threshold_cuts_dspark_proposals_mid_block(setup, tmp_path):
    """``confidence_threshold`` in the eval stage: DSpark's proposals are cut before their first slot below it
    (an untrained head's confidences straddle 0.5, so some steps keep part of the block; the fixed schedule
    verifies each proposal whole, so the cut is the threshold's), no evaluated
    confidence is below it, the output stays the target's greedy output, and the report records the
    threshold for DSpark only: Eagle3 has no confidence head and proposes whole blocks."""
    from deepspec.eval.stage import EvalConfig, run_eval_stage

    tok, targets, folders = setup
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"question": "1 + 1 = 1 + 1 = 1 + 1 = ?", "answer": "#### 2"}) + "\n")
    res = run_eval_stage(EvalConfig(draft=[str(folders["dspark"]), str(folders["eagle3"])], benchmarks=["gsm8k"],
                                    benchmark_files=[f"gsm8k={bench}"], num_prompts=1, max_new_tokens=24,
                                    compare_hf_generate=False, baselines=["none"], dtype="float32", schedule="fixed",
                                    confidence_threshold=0.5, output_dir=str(tmp_path / "e")),
                         target_model=targets["A"], tokenizer=tok)
    proposers = res["config"]["proposers"]
    dspark = next(n for n in proposers if n.startswith("dspark:"))
    eagle3 = next(n for n in proposers if n.startswith("eagle3:"))
    assert res["config"]["confidence_threshold"] == {dspark: 0.5}
    fig = res["benchmarks"]["gsm8k"][dspark]
    k = proposers[dspark]["max_proposal_len"]
    sizes = {int(n) for n in fig["proposal_sizes"]}
    assert any(0 < n < k for n in sizes), fig["proposal_sizes"]  # cut mid-block
    pooled = fig["calibration"]["pooled"]
    assert pooled["num_pairs"] > 0 and all(b["num_pairs"] == 0 for b in pooled["bins"] if b["hi"] <= 0.5)
    assert fig["frac_identical_to_baseline"] == 1.0
    whole = res["benchmarks"]["gsm8k"][eagle3]
    assert whole["frac_steps_truncated"] == 0.0 and whole["frac_identical_to_baseline"] == 1.0


def test_eval_lookup_corpus_feeds_the_lookup_rows_and_the_ngram_corpus_baseline(setup, tmp_path, capsys):
    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.eval.stage import EvalConfig, run_eval_stage

    tok, targets, folders = setup
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n")
    common = dict(draft=[str(folders["dspark"])], benchmarks=["gsm8k"], benchmark_files=[f"gsm8k={bench}"],
                  num_prompts=1, max_new_tokens=24, compare_hf_generate=False, dtype="float32", num_draft_tokens=2,
                  schedule="fixed")  # every proposal verified whole: the rows' tau compares what they propose
    # the corpus: the target's own answer to the same prompt, as prepare would have written it
    first = run_eval_stage(EvalConfig(**common, baselines=["none"], output_dir=str(tmp_path / "e0")),
                           target_model=targets["A"], tokenizer=tok)
    answer = tok(first["samples"]["gsm8k"]["target-only"][0]["output"], add_special_tokens=False)["input_ids"]
    prepared = tmp_path / "prepared.jsonl"
    prompt = load_benchmark("gsm8k", max_samples=1, path=bench)[0].turns[0]
    messages = [{"role": "user", "content": prompt + "\n"}, {"role": "assistant", "content": "..."}]
    prepared.write_text(json.dumps({"id": "x", "messages": messages, "generated_ids": [None, answer]}) + "\n")
    capsys.readouterr()
    res = run_eval_stage(EvalConfig(**common, baselines=["ngram", "ngram+corpus"], lookup_first=2,
                                    lookup_corpus=[str(prepared)], output_dir=str(tmp_path / "e1")),
                         target_model=targets["A"], tokenizer=tok)
    figures = res["benchmarks"]["gsm8k"]
    lookup = next(n for n in figures if n.endswith("+lookup"))
    # the corpus answers the evaluated prompt itself: said on stderr, in the config and in the report
    assert res["config"]["lookup_corpus"] == {"files": [str(prepared)], "num_sequences": 1, "num_tokens": len(answer),
                                              "prompts_answered": {"gsm8k": {"answered": 1, "of": 1,
                                                                             "ids": ["gsm8k-test-0000"]}}}
    assert (f"eval.lookup_corpus ({prepared}) holds the target's own answers to evaluated prompts (gsm8k 1/1)"
            in capsys.readouterr().err)
    for name in (lookup, "ngram+corpus"):
        assert figures[name]["frac_steps_from_corpus"] > 0.0, name  # the corpus holds the answer: it proposes
        assert figures[name]["frac_identical_to_baseline"] == 1.0
    assert figures["ngram+corpus"]["tau"] > figures["ngram"]["tau"]
    assert "frac_steps_from_corpus" not in figures["ngram"]
    assert "frac_steps_from_corpus" in res["definitions"]
    report = (tmp_path / "e1" / "eval_report.md").read_text()
    assert "Lookup corpus (deepspec.algorithms.ngram.corpus" in report
    assert "own answers to evaluated prompts (gsm8k 1 of 1): the rows that read it replay those answers" in report
