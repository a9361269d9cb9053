"""Small builders shared by several test modules."""

from __future__ import annotations


def byte_level_tokenizer(chat_template: str, *, extra_specials: tuple[str, ...] = ()):
    """A byte-level tokenizer (one token per byte, no merges) with ChatML specials.

    Ids 0..2 are ``<|endoftext|>`` (unk), ``<|im_start|>`` (bos) and ``<|im_end|>`` (eos and pad);
    ``extra_specials`` follow as additional special tokens, then the 256 byte symbols.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    extra = {"additional_special_tokens": list(extra_specials)} if extra_specials else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>", **extra)
    tok.chat_template = chat_template
    return tok


def mask_spans(mask) -> list[tuple[int, int]]:
    """Maximal runs of 1 in a 0/1 sequence, as ``(start, stop)`` pairs."""
    spans, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            spans.append((start, t))
            start = None
    return spans


def tiny_llama_target(tokenizer, *, seed: int = 0):
    """A frozen 3-layer Llama target (hidden 32) for ``tokenizer``'s vocabulary, seeded: the tiny
    target of the trainer tests (eval mode, no gradients, tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def sharp_tiny_llama(vocab_size: int = 64, *, max_position_embeddings: int = 128, seed: int = 0):
    """A frozen 2-layer random float32 Llama (hidden 32, EOS 1) whose ``lm_head`` is scaled by 8, so
    greedy decoding never sits on a near-tie: the tiny target of the decoding tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = LlamaForCausalLM(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


def write_tiny_gguf(path, *, seed: int = 0, chat_template: str | None = None, architecture: str = "llama",
                    tensors: bool = True, skip: tuple[str, ...] = (), layers: int | None = None, head_dim: int = 8,
                    keys: dict | None = None, extra_tensors: dict | None = None, std: float | None = None):
    """A tiny random target as a GGUF file (float32 tensors, width 32), and ``chat_template`` when given.

    ``architecture="llama"`` (2 layers) and ``"qwen3"`` (2 layers, with llama.cpp's per-head q/k norms): a
    byte-level tokenizer of 259 tokens (``<|endoftext|>``, ``<|im_start|>`` bos, ``<|im_end|>`` eos/pad, the
    256 byte symbols). ``"gemma3"`` (3 layers, sliding window 4, llama.cpp's Gemma 3 tensor names with its
    (1 + w) norms stored as 1 + w): a SentencePiece tokenizer with :data:`GEMMA_SPECIALS` (pad 0, eos 1, bos 2),
    the 256 byte-fallback tokens and lower-case pieces, as Gemma GGUF files carry, and no chat template unless
    given. Any other ``architecture`` / ``tensors=False`` write a header-only file declaring it; ``skip`` leaves
    the named GGUF tensors out.

    ``layers`` overrides the depth, ``head_dim`` the width of a head (4 query and 2 key/value heads; written
    as ``attention.key_length`` when it is not 32 / 4); ``keys`` sets (or, with None, leaves out) header keys
    of the architecture's namespace, by the part after ``<arch>.`` (str, float32, uint32 or bool by the
    value's type); ``extra_tensors`` adds float32 tensors by GGUF name; ``std`` is the weights' standard deviation
    (default 0.05, Gemma 0.3; norms 0.05 around their 1 or 0). Returns ``path``."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    gemma = architecture == "gemma3"
    if gemma:
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
        pieces = ["\u2581", *letters, *("\u2581" + c for c in letters)]
        tokens = [*GEMMA_SPECIALS, *(f"<0x{i:02X}>" for i in range(256)), *pieces]
        types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
        scores = [0.0] * (len(GEMMA_SPECIALS) + 256) + [-float(i) for i in range(len(pieces))]
        L = 3
    else:
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
        types, scores, L = [3, 3, 3] + [1] * 256, [0.0] * len(tokens), 2
    L = layers or L
    V, H, I, NH, NKV, D = len(tokens), 32, 64, 4, 2, head_dim
    w = gguf.GGUFWriter(str(path), architecture)
    header = {"block_count": L, "context_length": 128, "embedding_length": H, "feed_forward_length": I,
              "attention.head_count": NH, "attention.head_count_kv": NKV, "rope.freq_base": 10000.0,
              "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": V}
    if gemma or D != H // NH:
        header.update({"attention.key_length": D, "attention.value_length": D})
    if gemma:
        header["attention.sliding_window"] = 4
    header.update(keys or {})
    for suffix, value in header.items():
        key = f"{architecture}.{suffix}"
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    w.add_tokenizer_model("llama" if gemma else "gpt2")
    if not gemma:
        w.add_tokenizer_pre("default")
        w.add_token_merges([])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    if gemma:
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_pad_token_id(0)
        w.add_unk_token_id(3)
    else:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if tensors:
        rng = np.random.default_rng(seed)

        def add(name, *shape, norm=False):
            scale = 0.05 if norm else std if std is not None else 0.3 if gemma else 0.05
            values = (rng.standard_normal(shape) * scale).astype(np.float32)
            if norm and gemma:
                values += 1.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
            if name not in skip:
                w.add_tensor(name, values)

        add("token_embd.weight", V, H)
        add("output_norm.weight", H, norm=True)
        if not gemma:
            add("output.weight", V, H)
        for i in range(L):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", H, norm=True)
            add(p + "ffn_norm.weight", H, norm=True)
            if gemma:
                for name in ("post_attention_norm", "post_ffw_norm"):
                    add(p + name + ".weight", H, norm=True)
            if gemma or architecture == "qwen3":
                add(p + "attn_q_norm.weight", D, norm=True)
                add(p + "attn_k_norm.weight", D, norm=True)
            add(p + "attn_q.weight", NH * D, H)
            add(p + "attn_k.weight", NKV * D, H)
            add(p + "attn_v.weight", NKV * D, H)
            add(p + "attn_output.weight", H, NH * D)
            add(p + "ffn_gate.weight", I, H)
            add(p + "ffn_up.weight", I, H)
            add(p + "ffn_down.weight", H, I)
        for name, values in (extra_tensors or {}).items():
            w.add_tensor(name, np.asarray(values, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"


def qwen3_tokenizer_dir():
    """A folder holding the real Qwen3 tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), unpacked
    once from ``tests/fixtures/qwen3_tokenizer/`` into the system temporary directory.

    Raises:
        ValueError: the unpacked ``tokenizer.json`` does not have the fixture's sha256 (a damaged fixture).
    """
    import hashlib
    import lzma
    import os
    import shutil
    import tempfile
    from pathlib import Path

    src = Path(__file__).resolve().parent / "fixtures" / "qwen3_tokenizer"
    out = Path(tempfile.gettempdir()) / f"deepspec-qwen3-tokenizer-{QWEN3_TOKENIZER_SHA256[:12]}"
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    data = lzma.decompress((src / "tokenizer.json.xz").read_bytes())
    if hashlib.sha256(data).hexdigest() != QWEN3_TOKENIZER_SHA256:
        raise ValueError(f"{src / 'tokenizer.json.xz'}: unpacks to a tokenizer.json whose sha256 is not "
                         f"{QWEN3_TOKENIZER_SHA256}; restore the fixture from git")
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))  # complete, then renamed into place
    (tmp / "tokenizer.json").write_bytes(data)
    shutil.copyfile(src / "tokenizer_config.json", tmp / "tokenizer_config.json")
    try:
        os.rename(tmp, out)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_bench_module(name: str):
    """``bench/<name>.py`` imported as a module (the bench scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingBackend:
    """A torch.compile backend that runs the captured graph eagerly and counts the compilations
    (dynamo still captures the whole graph: padding, caches and recompiles are checked without code
    generation)."""

    def __init__(self):
        self.num_graphs = 0

    def __call__(self, gm, example_inputs):
        self.num_graphs += 1
        return gm.forward


_FLEX_CPU_PROBE: list[str | None] = []


def require_flex_attention_on_cpu() -> None:
    """Skip the calling test when this torch build cannot run eager flex_attention forward on the CPU.

    The capability is probed once, on a plain causal mask built here, never on the code under test: a
    failure of the project's own flex code (its block masks, its calls) fails the test, not skips it.
    """
    import warnings

    import pytest
    import torch

    if not _FLEX_CPU_PROBE:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 8, 8, device="cpu")
                x = torch.randn(1, 1, 8, 8)
                flex_attention(x, x, x, block_mask=mask)
            _FLEX_CPU_PROBE.append(None)
        except (ImportError, RuntimeError, NotImplementedError) as e:  # pragma: no cover - depends on torch build
            _FLEX_CPU_PROBE.append(f"{type(e).__name__}: {e}")
    if _FLEX_CPU_PROBE[0] is not None:  # pragma: no cover - depends on torch build
        pytest.skip(f"flex_attention forward unavailable on CPU in this torch build: {_FLEX_CPU_PROBE[0]}")
