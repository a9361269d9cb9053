"""The one decoding set-up (deepspec.decoding.settings): DecodeSettings names a bad field, splits
--tree-width in two, and eval, serve and bench/decode all build their proposers through
build_proposers (the same settings give the same proposers); the target loader (open_target)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import deepspec.decoding.settings as settings_mod
from deepspec.algorithms.registry import load_draft
from deepspec.decoding.settings import DecodeSettings, build_proposers
from deepspec.target.load import open_target, target_fingerprint
from tests.helpers import byte_level_tokenizer, load_bench_module

try:
    from tests.unit.test_chat import CHATML
    from tests.unit.test_draft_target import setup as targets_and_drafts  # noqa: F401 (a fixture)
except ImportError:  # pytest run from another folder
    from test_chat import CHATML
    from test_draft_target import setup as targets_and_drafts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(targets_and_drafts):
    """(tokenizer, a tiny Llama target, {algorithm: saved draft folder made for it}): test_draft_target's."""
    tok, targets, folders = targets_and_drafts
    return tok, targets["A"], folders


def signature(proposer) -> tuple:
    """What a proposer was built with: its kind and K, its draft's kind, K, tree width and confidence cut,
    a lookup's range, K and whether its match is verified beside the draft, an n-gram baseline's range."""
    draft = getattr(proposer, "draft", proposer)
    lookup = getattr(proposer, "lookup", None)
    own = lookup or proposer
    return (type(proposer).__name__, proposer.max_proposal_len, type(draft).__name__, draft.max_proposal_len,
            getattr(draft, "tree_width", None), getattr(draft, "confidence_threshold", None),
            getattr(proposer, "tree", None), getattr(own, "ngram_max", None), getattr(own, "ngram_min", None),
            None if lookup is None else lookup.max_proposal_len)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"num_draft_tokens": 0}, "DecodeSettings.num_draft_tokens: expected an integer >= 1"),
    ({"draft_tree_width": 0}, "DecodeSettings.draft_tree_width: expected an integer >= 1"),
    ({"draft_tree_width": 2, "confidence_threshold": 0.5}, "DecodeSettings.draft_tree_width: a draft tree is not cut"),
    ({"lookup_beside_draft": True, "compile": True}, "DecodeSettings.lookup_beside_draft: draft trees need the eager"),
    ({"lookup_beside_draft": 1}, "DecodeSettings.lookup_beside_draft: expected true or false"),
    ({"confidence_threshold": 1.0}, "DecodeSettings.confidence_threshold: expected a value in [0, 1)"),
    ({"lookup_num_tokens": 5}, "DecodeSettings.lookup_num_tokens: set without DecodeSettings.lookup_first"),
    ({"ngram_max": 2, "ngram_min": 3}, "DecodeSettings.ngram_min: expected <= ngram_max"),
    ({"corpus_ngram_min": 9}, "DecodeSettings.corpus_ngram_min: expected an integer in [1, 4]"),
    ({"baselines": "ngram"}, "DecodeSettings.baselines: expected a list of names"),
    ({"baselines": ["eagle"]}, "DecodeSettings.baselines: expected some of"),
    ({"dtype": "fp16"}, "DecodeSettings.dtype: expected one of auto, float32, bfloat16"),
    ({"device": "gpu"}, "DecodeSettings.device: expected auto, cpu, cuda or cuda:N"),
    ({"few_row_linear": "on", "compile": True}, "DecodeSettings.few_row_linear: on cannot be combined"),
    ({"schedule": "fast"}, "DecodeSettings.schedule: expected one of auto, fixed, got 'fast'"),
    ({"exact": True, "compile": True}, "DecodeSettings.exact: exact rows need the eager target path"),
    ({"exact": "yes"}, "DecodeSettings.exact: expected true or false"),
])
def test_a_bad_setting_names_its_field(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        DecodeSettings(**kwargs)


def test_a_stage_names_its_own_flags_and_the_settings_are_frozen_and_canonical():
    with pytest.raises(ValueError, match=r"serve\.num_draft_tokens: expected an integer >= 1"):
        DecodeSettings.from_flags("serve", num_draft_tokens=0)
    with pytest.raises(ValueError, match=r"eval\.tree_width: a draft tree is not cut by confidence"):
        DecodeSettings.from_flags("eval", tree_width=2, confidence_threshold=0.5)
    with pytest.raises(ValueError, match=r"bench\.tree_width: draft trees need the eager target path"):
        DecodeSettings.from_flags("bench", tree_width=1, compile=True)
    with pytest.raises(ValueError, match=r"demo\.tree_width: expected an integer >= 0"):
        DecodeSettings.from_flags("demo", tree_width=-1)
    with pytest.raises(ValueError, match=r"eval\.schedule: expected one of auto, fixed"):
        DecodeSettings.from_flags("eval", schedule="Auto")
    s = DecodeSettings(dtype="bf16", baselines=["ngram", "ngram"])
    assert (s.dtype, s.baselines) == ("bfloat16", ("ngram",))
    assert DecodeSettings(baselines=["none"]).baselines == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_draft_tokens = 3


@pytest.mark.parametrize(("tree_width", "draft_tree_width", "lookup_beside_draft"),
                         [(0, 1, False), (1, 1, True), (3, 3, True)])
def test_tree_width_means_two_fields(tree_width, draft_tree_width, lookup_beside_draft):
    s = DecodeSettings.from_flags("eval", tree_width=tree_width)
    assert (s.draft_tree_width, s.lookup_beside_draft, s.tree_width) == (draft_tree_width, lookup_beside_draft,
                                                                         tree_width)


def test_eval_serve_and_bench_build_the_same_proposers_through_build_proposers(setup, tmp_path, monkeypatch):
    from deepspec.eval import stage
    from deepspec.eval.stage import EvalConfig, run_eval_stage
    from deepspec.serve import decoder as serve_decoder
    from deepspec.serve.decoder import EngineDecoder

    tok, target, folders = setup
    calls = []

    def spy(settings, *args, where="decode", **kwargs):
        calls.append(where)
        return build_proposers(settings, *args, where=where, **kwargs)

    for module in (stage, serve_decoder, settings_mod):  # bench/decode imports it from settings when it runs
        monkeypatch.setattr(module, "build_proposers", spy)
    flags = dict(num_draft_tokens=2, lookup_first=2, lookup_num_tokens=5, tree_width=2, dtype="float32")

    # eval: the proposers handed to the run
    class Captured(Exception):
        pass

    def capture(target_model, tokenizer, layer_ids, proposers, benchmarks, **kw):
        raise Captured(proposers)

    monkeypatch.setattr(stage, "run_eval", capture)
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    cfg = EvalConfig(draft=[str(folders["dspark"])], output_dir=str(tmp_path / "e"), benchmarks=["gsm8k"],
                     benchmark_files=[f"gsm8k={bench}"], ngram_num_tokens=5, **flags)
    with pytest.raises(Captured) as got:
        run_eval_stage(cfg, target_model=target, tokenizer=tok)
    evaluated = got.value.args[0]
    names = list(evaluated)
    assert names[0].startswith("dspark:") and names == [names[0], f"{names[0]}+lookup", "ngram"]
    assert calls == ["eval"]

    # the same settings, built directly
    _, draft = load_draft(folders["dspark"], target_model=target)
    direct = build_proposers(cfg.decode_settings(), target, {names[0]: draft.eval()})
    assert [signature(p) for p in direct.values()] == [signature(p) for p in evaluated.values()]
    assert signature(evaluated[names[1]])[:7] == ("LookupFirstProposer", 5, "DSparkProposer", 2, 2, None, True)

    # serve: the draft behind prompt lookup, its row of the eval
    calls.clear()
    decoder = EngineDecoder(target, tok, draft=folders["dspark"], **flags)
    assert calls == ["serve"] and signature(decoder.proposer) == signature(evaluated[names[1]])

    settings = DecodeSettings.from_flags("serve", **{**flags, "device": "cpu"})
    same = EngineDecoder(target, tok, draft=folders["dspark"], settings=settings)
    assert same.settings == decoder.settings and signature(same.proposer) == signature(decoder.proposer)
    with pytest.raises(ValueError, match="serve: num_draft_tokens given beside settings"):
        EngineDecoder(target, tok, draft=folders["dspark"], settings=settings, num_draft_tokens=2)

    # bench/decode: its rows from the settings without lookup and trees, varied per row
    calls.clear()
    base = DecodeSettings(num_draft_tokens=2, ngram_num_tokens=5, baselines=("ngram",), dtype="float32")
    rows = load_bench_module("decode").bench_proposers(base, target, draft, tree_widths=[2], lookup_first=[2],
                                                       lookup_num_tokens=5)
    assert list(rows) == ["speculative", "ngram", "speculative-tree2", "lookup-first-n2-tree2"]
    assert len(calls) == 3  # the plain rows, the tree row, the lookup row
    assert signature(rows["speculative-tree2"]) == signature(evaluated[names[0]])
    assert signature(rows["lookup-first-n2-tree2"]) == signature(evaluated[names[1]])
    assert signature(rows["ngram"]) == signature(evaluated["ngram"])
    assert signature(rows["speculative"])[4] == 1  # the chain


def test_build_proposers_k_names_and_confidence(setup):
    tok, target, folders = setup
    _, dspark = load_draft(folders["dspark"], target_model=target)
    _, eagle3 = load_draft(folders["eagle3"], target_model=target)
    out = build_proposers(DecodeSettings(num_draft_tokens=3, baselines=("ngram",)), target,
                          {"ngram": eagle3, "d": dspark})
    assert list(out) == ["ngram", "d", "ngram#2"]  # a name already taken gets #2
    assert out["ngram#2"].max_proposal_len == out["ngram"].max_proposal_len == 3  # the first draft's K, capped
    cut = build_proposers(DecodeSettings(confidence_threshold=0.5), target, {"e": eagle3, "d": dspark})
    assert cut["d"].confidence_threshold == 0.5  # a draft with a confidence head is cut; Eagle3 has none
    with pytest.raises(ValueError, match=r"eval\.confidence_threshold: 0\.5 needs a draft with a confidence head"):
        build_proposers(DecodeSettings(confidence_threshold=0.5), target, {"e": eagle3}, where="eval")


def test_open_target_fingerprints_before_the_cast_and_copies_a_callers_model(setup):
    tok, target, _ = setup
    before = target_fingerprint(target)
    loaded = open_target("tiny", model=target, tokenizer=tok, dtype=torch.bfloat16)
    assert loaded.fingerprint == before and not loaded.loaded_here
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32  # the caller's model keeps its dtype
    assert open_target("tiny", model=target, tokenizer=tok, dtype=torch.float32).model is target
    assert loaded.default_layer_ids(1) == [2]  # L = 4: one layer, L // 2
    tok_without = byte_level_tokenizer(CHATML)
    tok_without.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        open_target("tiny", model=target, tokenizer=tok_without)
    assert open_target("tiny", model=target, tokenizer=tok_without, require_template=False).tokenizer is tok_without


def test_a_server_measures_its_step_costs_once_and_shares_one_scheduler_across_requests(setup):
    from deepspec.decoding.schedule import StepScheduler
    from deepspec.serve.decoder import EngineDecoder
    from deepspec.target.decoding import SamplingParams

    tok, target, folders = setup
    decoder = EngineDecoder(target, tok, draft=folders["dspark"], dtype="float32")
    scheduler = decoder.scheduler
    assert isinstance(scheduler, StepScheduler)  # measured at start-up, before any request
    for prompt in ([5, 6, 7, 8], [9, 10, 11]):
        decoder.generate(prompt, max_new_tokens=6, sampling=SamplingParams())
    assert decoder.scheduler is scheduler and scheduler.num_observed > 0  # the requests' steps taught the one
    fixed = EngineDecoder(target, tok, draft=folders["dspark"], dtype="float32", schedule="fixed", exact=True)
    assert fixed.scheduler is None and fixed._engine([1]).exact  # --exact reaches the server's engines
    with pytest.raises(ValueError, match=r"serve\.schedule: expected one of auto, fixed"):
        EngineDecoder(target, tok, draft=folders["dspark"], schedule="always")
