"""A GGUF target is the model its header declares, in llama.cpp's meaning of the keys (docs/design/targets.md,
"GGUF"): tiny random GGUF files written by :func:`tests.helpers.write_tiny_gguf` are converted and their logits
compared with :func:`reference_logits`, a forward pass written from the GGUF's own tensors and keys as llama.cpp
runs it (not through transformers, whose GGUF loader drops some of them). Keys and tensors DeepSpec cannot apply
are refused by name, before any weight is converted.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from deepspec.target.load import load_target, resolve_target_dir
from tests.helpers import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5, 70, 9, 200, 31, 31, 102, 7, 250, 64, 3, 140, 18, 99, 230, 41, 77, 12, 160, 8, 55, 190, 6, 120]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: torch.Tensor, neox: bool) -> torch.Tensor:
    """ggml's RoPE on ``x`` (T, heads, D) with angles ``theta`` (T, D/2): pairs (2i, 2i+1) in llama.cpp's normal
    mode (Llama), (i, i + D/2) in NEOX mode (Qwen, Gemma)."""
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    if neox:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def reference_logits(path, ids: list[int], *, ignore: tuple[str, ...] = ()) -> torch.Tensor:
    """Logits (len(ids), vocab), float64, of GGUF file ``path`` as llama.cpp computes them, from the file's own
    tensors (in llama.cpp's layout: Llama's q/k rows un-permuted, Gemma's norms stored as 1 + w) and keys:
    ``rope.freq_base``, ``rope.scaling.factor`` (linear: positions divided by it), ``rope_freqs.weight`` (Llama:
    frequency of pair i divided by entry i), ``attention.key_length``, the query scale (1/sqrt(key_length)),
    Gemma 3's every-6th-layer-global pattern with ``attention.sliding_window`` (a key ``window`` or more positions
    back is masked) and unscaled base-10000 RoPE on sliding layers, its sqrt(width) embedding scale, GELU (tanh)
    and ``final_logit_softcapping``. ``ignore`` names keys/tensors to leave out (to show what dropping them does)."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    W = {t.name: torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64))
         for t in reader.tensors if t.name not in ignore}
    arch = fields["general.architecture"]

    def key(suffix, default=None):
        return default if suffix in ignore else fields.get(f"{arch}.{suffix}", default)

    gemma, neox = arch == "gemma3", arch in ("gemma3", "qwen2", "qwen3")
    L, H, NH = key("block_count"), key("embedding_length"), key("attention.head_count")
    NKV, D = key("attention.head_count_kv", NH), key("attention.key_length", H // NH)
    eps, base = key("attention.layer_norm_rms_epsilon"), key("rope.freq_base", 10000.0)
    freq_scale = 1.0 / (key("rope.scaling.factor") or 1.0)
    factors = W.get("rope_freqs.weight", torch.ones(D // 2)).reshape(-1)
    window, cap = key("attention.sliding_window"), key("final_logit_softcapping")
    T = len(ids)
    pos = torch.arange(T, dtype=torch.float64)
    x = W["token_embd.weight"][ids]
    if gemma:
        x = x * math.sqrt(H)
    for il in range(L):
        p = f"blk.{il}."
        swa = gemma and il % 6 < 5
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, NH, D)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, NKV, D)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, NKV, D)
        if p + "attn_q_norm.weight" in W:
            q, k = _rms(q, W[p + "attn_q_norm.weight"], eps), _rms(k, W[p + "attn_k_norm.weight"], eps)
        layer_base, layer_scale = (10000.0, 1.0) if swa else (base, freq_scale)
        inv = layer_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D) / (1.0 if swa else factors)
        theta = pos[:, None] * layer_scale * inv[None, :]
        q, k = _rope(q, theta, neox), _rope(k, theta, neox)
        k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        masked = pos[None, :] > pos[:, None]
        if swa:
            masked = masked | (pos[:, None] - pos[None, :] >= window)
        att = torch.softmax(scores.masked_fill(masked, -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(T, NH * D) @ W[p + "attn_output.weight"].T
        if gemma:
            o = _rms(o, W[p + "post_attention_norm.weight"], eps)
        x = x + o
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        gate = h @ W[p + "ffn_gate.weight"].T
        gate = torch.nn.functional.gelu(gate, approximate="tanh") if gemma else torch.nn.functional.silu(gate)
        f = (gate * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        if gemma:
            f = _rms(f, W[p + "post_ffw_norm.weight"], eps)
        x = x + f
    logits = _rms(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T
    return cap * torch.tanh(logits / cap) if cap else logits


def _target_logits(path) -> torch.Tensor:
    model, _ = load_target(str(path))
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].double()


def _llama3_factors(dim: int, base: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter writes it for a Llama 3.1 ``rope_scaling`` (llama3)."""
    out = []
    for freq in base ** (-np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _case(name, tmp_path):
    """(GGUF file, what the converted config must say) for each forward-changing header case."""
    if name == "llama-linear-x4":
        path = write_tiny_gguf(tmp_path / f"{name}.gguf", std=0.5, keys={"rope.scaling.type": "linear",
                                                                 "rope.scaling.factor": 4.0})
        return path, {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}, \
            ("rope.scaling.factor",)
    if name == "llama3-rope-freqs":
        factors = _llama3_factors(16, 10000.0, 8.0, 1.0, 8.0, 64)
        assert ((factors > 1.0) & (factors < 8.0)).sum() == 2  # two pairs in the smoothly scaled band
        path = write_tiny_gguf(tmp_path / f"{name}.gguf", std=0.5, head_dim=16, keys={"rope.dimension_count": 16},
                               extra_tensors={"rope_freqs.weight": factors})
        return path, {"head_dim": 16}, ("rope_freqs.weight",)
    if name == "gemma3-global-linear-x8":
        path = write_tiny_gguf(tmp_path / f"{name}.gguf", architecture="gemma3", layers=6, head_dim=16,
                               keys={"rope.freq_base": 1000000.0, "rope.scaling.type": "linear",
                                     "rope.scaling.factor": 8.0, "final_logit_softcapping": 2.0})
        return path, {"head_dim": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 2.0,
                      "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, ("rope.scaling.factor",)
    assert name == "qwen3-key-length"
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", architecture="qwen3", std=0.5, head_dim=16,
                           keys={"rope.freq_base": 1000.0})
    return path, {"head_dim": 16}, ()


@pytest.mark.parametrize("name", ["llama-linear-x4", "llama3-rope-freqs", "gemma3-global-linear-x8",
                                  "qwen3-key-length"])
def test_the_converted_target_runs_the_forward_pass_its_gguf_header_declares(tmp_path, home, name):
    path, fields, dropped = _case(name, tmp_path)
    want = reference_logits(path, IDS)
    if dropped:  # the key or tensor matters: leaving it out gives other logits
        assert (reference_logits(path, IDS, ignore=dropped) - want).abs().max() > 1e-3
    got = _target_logits(path)
    assert (got - want).abs().max() < 2e-5, float((got - want).abs().max())
    config = json.loads((resolve_target_dir(str(path)) / "config.json").read_text())
    for field, value in fields.items():
        assert config[field] == value or {k: config[field].get(k) for k in value} == value, field
    if name == "llama3-rope-freqs":
        assert config["rope_parameters"]["rope_type"] == "llama3"
        assert config["rope_parameters"]["factor"] == pytest.approx(8.0)
    if name == "gemma3-global-linear-x8":
        assert config["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0}
        assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


def test_a_folder_converted_without_the_header_is_converted_again(tmp_path, home):
    path, _, _ = _case("llama-linear-x4", tmp_path)
    folder = resolve_target_dir(str(path))
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # as an earlier conversion wrote it
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_target_dir(str(path)) == folder
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"
    assert (_target_logits(path) - reference_logits(path, IDS)).abs().max() < 2e-5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keys": {"attention.scale": 0.5}}, r"llama\.attention\.scale = 0\.5: DeepSpec does not know how this llama key"),
    ({"keys": {"logit_scale": 2.0}}, r"llama\.logit_scale = 2\.0: DeepSpec does not know"),
    ({"keys": {"expert_count": 8}}, r"llama\.expert_count = 8: DeepSpec does not know"),
    ({"keys": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}},
     r"llama\.rope\.scaling\.type = 'yarn': with llama\.rope\.scaling\.factor = 4\.0: DeepSpec converts only a "
     "linear"),
    ({"keys": {"rope.scaling.attn_factor": 1.5}}, r"llama\.rope\.scaling\.attn_factor = 1\.5: llama\.cpp multiplies"),
    ({"keys": {"rope.dimension_count": 4}}, r"llama\.rope\.dimension_count = 4: RoPE on 4 of the 8 dimensions"),
    ({"head_dim": 16, "keys": {"attention.value_length": 8, "rope.dimension_count": 16}},
     r"llama\.attention\.value_length = 8: differs from the key length 16"),
    ({"extra_tensors": {"blk.0.attn_q.bias": np.zeros(32)}},
     r"blk\.0\.attn_q\.bias = 'a tensor of shape \(32,\)': 1 GGUF tensor\(s\) \(blk\.0\.attn_q\.bias\) are no weight"),
    ({"extra_tensors": {"rope_freqs.weight": np.array([1.0, 3.0, 1.5, 2.0])}},
     r"rope_freqs\.weight = \[1\.0, 3\.0, 1\.5, 2\.0\]: these RoPE frequency factors .* are not Llama 3's"),
    ({"keys": {"rope.scaling.factor": 2.0}, "extra_tensors": {"rope_freqs.weight": np.ones(4) * 2}},
     r"rope_freqs\.weight = 'a tensor': together with a linear RoPE factor 2\.0"),
    ({"architecture": "gemma3", "keys": {"attention.sliding_window": None}},
     r"gemma3\.attention\.sliding_window = None: a Gemma 3 without sliding-window layers"),
    ({"architecture": "gemma3", "keys": {"attn_logit_softcapping": 50.0}},
     r"gemma3\.attn_logit_softcapping = 50\.0: DeepSpec does not know"),
    ({"architecture": "qwen3", "extra_tensors": {"rope_freqs.weight": np.ones(4)}},
     r"rope_freqs\.weight = 'a tensor': llama\.cpp's qwen3 does not read this tensor"),
])
def test_header_keys_and_tensors_deepspec_cannot_apply_are_refused_by_name(tmp_path, home, kwargs, message):
    path = write_tiny_gguf(tmp_path / "refused.gguf", **kwargs)
    with pytest.raises(ValueError, match=message) as info:
        resolve_target_dir(str(path))
    assert "refused.gguf" in str(info.value)
    assert not (home / "targets").exists() or not any((home / "targets").iterdir())  # refused before converting


def test_architectures_deepspec_does_not_check_are_refused(tmp_path, home):
    path = write_tiny_gguf(tmp_path / "phi3.gguf", architecture="phi3")
    with pytest.raises(ValueError, match=r"DeepSpec converts GGUF files of the architectures llama, qwen2, qwen3, "
                                         r"gemma3 only .* 'phi3' is not one of them"):
        resolve_target_dir(str(path))
