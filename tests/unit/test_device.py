"""The decoding dtype rule (deepspec.device): names, aliases, ``auto`` on CPU with and without native
bf16, and the cast copy that leaves the caller's module alone."""

from __future__ import annotations

import pytest
import torch

import deepspec.device as device_mod
from deepspec.device import cast_for_decoding, check_dtype_name, dtype_name, resolve_dtype


def test_names_and_aliases():
    assert check_dtype_name("auto", "eval.dtype") == "auto"
    assert check_dtype_name("bf16", "eval.dtype") == "bfloat16"
    assert check_dtype_name("fp32", "eval.dtype") == "float32"
    for bad in ("float16", "BF16", None, 3):
        with pytest.raises(ValueError, match="eval.dtype: expected one of auto, float32, bfloat16"):
            check_dtype_name(bad, "eval.dtype")
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bf16") is torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16"


def test_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ())
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16  # an explicit choice is kept


def test_cpu_flags_are_a_subset_of_the_known_ones():
    assert set(device_mod.cpu_bf16_flags()) <= set(device_mod.CPU_BF16_FLAGS)


def test_cast_for_decoding_copies_only_when_needed():
    layer = torch.nn.Linear(4, 4)
    assert cast_for_decoding(layer, torch.float32) is layer
    cast = cast_for_decoding(layer, torch.bfloat16)
    assert cast is not layer and cast.weight.dtype is torch.bfloat16 and layer.weight.dtype is torch.float32


def test_configs_validate_dtype(tmp_path):
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig
    from deepspec.eval.stage import EvalConfig

    assert EvalConfig(draft=["x"], output_dir="o", dtype="bf16").dtype == "bfloat16"
    assert PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", dtype="fp32").dtype == "float32"
    assert DemoConfig(dtype="auto").dtype == "auto"
    with pytest.raises(ValueError, match="eval.dtype"):
        EvalConfig(draft=["x"], output_dir="o", dtype="half")
    with pytest.raises(ValueError, match="PrepareConfig.dtype"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", dtype="half")
    with pytest.raises(ValueError, match="demo.dtype"):
        DemoConfig(dtype="int8")
