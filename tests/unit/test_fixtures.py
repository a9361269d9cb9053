"""The shipped copy of the real Qwen3 tokenizer (tests/fixtures/qwen3_tokenizer) is the one in ../shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import qwen3_tokenizer_dir

SHARED = Path(__file__).resolve().parents[3] / "shared" / "tokenizers" / "qwen3"


def test_the_qwen3_fixture_unpacks_to_the_real_tokenizer():
    from transformers import AutoTokenizer

    folder = qwen3_tokenizer_dir()
    assert qwen3_tokenizer_dir() == folder  # unpacked once
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 151_669 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<think>"]) == [151_645, 151_667]
    if not SHARED.is_dir():
        pytest.skip("../shared/tokenizers/qwen3 is not beside the checkout")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (SHARED / name).read_bytes(), name
