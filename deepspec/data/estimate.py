"""``deepspec estimate``: how large a target cache will be, before building it
(docs/design/cache.md, "Cache size and fp8 storage").

Bytes per token come from :func:`deepspec.data.cache.format.cache_bytes_per_token` (the format's exact
per-token cost; per-sample offsets, 8 bytes a sample, and shard headers are left out). The
dataset size is a token count: measured from a prepared JSONL file with the cache writer's own
rendering and truncation rule, given directly, or given as conversations x tokens per conversation.
The table lists every storage mode and the original DeepSpec layout (bfloat16 + a per-token uint8
attention mask: ``6 + 2*H*(n+1)``, 30,726 bytes a token for Qwen3-4B with 5 target layers).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepspec.data.cache.format import STORAGE_DTYPES, cache_bytes_per_token, check_storage_dtype
from deepspec.data.cache.samples import iter_prepared_samples
from deepspec.data.conversations import read_jsonl
from deepspec.target.capture import default_target_layer_ids, validate_target_layer_ids
from deepspec.target.load import load_tokenizer, resolve_target_dir
from deepspec.utils import format_bytes


@dataclass(kw_only=True)
class EstimateConfig:
    """``deepspec estimate``: cache size for a target config, a layer count and a dataset size.

    Exactly one dataset size source may be given: ``input`` (a prepared JSONL, measured through
    the target's tokenizer), ``num_tokens``, or ``num_conversations`` with
    ``tokens_per_conversation``; with none, only bytes per token are printed.
    """

    target: str = "default"  # "default", a Hugging Face model folder, or a config.json path
    num_target_layers: int = 5  # n, when target_layer_ids is None
    target_layer_ids: list[int] | None = None  # overrides num_target_layers (n = its length)
    storage_dtype: str = "bfloat16"  # the mode marked in the table (all modes are listed)
    input: str | None = None  # prepared JSONL to measure the token count from
    max_seq_len: int | None = 1024  # truncation applied when measuring (as `deepspec cache`)
    num_tokens: int | None = None  # dataset size in tokens, given directly
    num_conversations: int | None = None  # with tokens_per_conversation: size = their product
    tokens_per_conversation: float | None = None  # mean tokens per conversation (with num_conversations)

    def __post_init__(self) -> None:
        check_storage_dtype(self.storage_dtype, "estimate.storage_dtype")
        if self.num_target_layers < 1:
            raise ValueError(f"estimate.num_target_layers: expected >= 1, got {self.num_target_layers}")
        sources = [self.input is not None, self.num_tokens is not None,
                   self.num_conversations is not None or self.tokens_per_conversation is not None]
        if sum(sources) > 1:
            raise ValueError("estimate: give at most one dataset size: --input, --num-tokens, or "
                             "--num-conversations with --tokens-per-conversation")
        if sources[2] and (self.num_conversations is None or self.tokens_per_conversation is None):
            raise ValueError("estimate.num_conversations and estimate.tokens_per_conversation go together; "
                             f"got {self.num_conversations!r} and {self.tokens_per_conversation!r}")
        for name in ("num_tokens", "num_conversations", "tokens_per_conversation", "max_seq_len"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"estimate.{name}: expected a positive number, got {v}")


def read_target_config(target: str) -> tuple[dict[str, Any], Path]:
    """``(config dict, config.json path)`` of a target spec: ``"default"`` (the embedded SmolLM2,
    converted if needed), a model folder holding config.json, or a config.json path. For
    multimodal configs the text model's ``text_config`` is returned.

    Raises FileNotFoundError when no config.json is found, ValueError for a file that is not a JSON
    config object (a GGUF file is named as one) or a config without ``hidden_size`` / ``num_hidden_layers``.
    """
    if target == "default":
        path = resolve_target_dir(target) / "config.json"
    else:
        p = Path(target).expanduser()
        path = p / "config.json" if p.is_dir() else p
    if not path.is_file():
        raise FileNotFoundError(f"estimate.target={target!r}: no config.json at {path}; pass 'default', a "
                                f"Hugging Face model folder, or the path of a config.json")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        raise ValueError(f"estimate.target={target!r}: {path} is a GGUF file; estimate reads a Hugging Face config.json. "
                         f"Pass the model's Hugging Face folder (or its config.json), or 'default' for the embedded "
                         f"target.")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"estimate.target={target!r}: {path} is not a JSON config ({exc}); pass a Hugging Face "
                         f"model folder or the path of its config.json.") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"estimate.target={target!r}: {path} holds a JSON {type(cfg).__name__}, not a config object.")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    for key in ("hidden_size", "num_hidden_layers"):
        if key not in cfg:
            raise ValueError(f"{path}: no {key!r}; expected a decoder-only language model config")
    return cfg, path


# Any of these makes AutoTokenizer load a real vocabulary; without them it builds an empty tokenizer
# from config.json alone, which then fails later with a misleading "no chat_template".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_folder_tokenizer(folder: Path) -> Any:
    """The tokenizer of the model folder holding the target's config.json.

    Raises ValueError when the folder holds no tokenizer files (or they give an empty vocabulary).
    """
    hint = (f"--input needs the target's tokenizer; {folder} has no tokenizer files (tokenizer.json / "
            f"tokenizer_config.json); pass the model folder or use --num-tokens")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(hint)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if len(tokenizer) < 16:  # a config-only tokenizer has a handful of special tokens at most
        raise ValueError(hint + f" (the tokenizer found there has only {len(tokenizer)} tokens)")
    return tokenizer


def count_prepared_tokens(path: str | Path, tokenizer: Any, *, max_seq_len: int | None) -> dict[str, int]:
    """Token counts of a prepared JSONL as the cache writer would store it: rows rendered by
    :func:`deepspec.data.cache.samples.render_prepared_row`, held-out rows skipped, samples truncated to
    ``max_seq_len``, samples without a loss token refused. Returns ``num_rows``, ``num_heldout``,
    ``num_samples``, ``num_tokens``, ``num_loss_tokens``."""
    counts: dict[str, int] = {}
    totals = dict(num_samples=0, num_tokens=0, num_loss_tokens=0)
    for _, ids, mask in iter_prepared_samples(read_jsonl(path), tokenizer, max_seq_len=max_seq_len, counts=counts):
        totals["num_samples"] += 1
        totals["num_tokens"] += len(ids)
        totals["num_loss_tokens"] += sum(mask)
    counts = {"num_rows": counts["num_rows"], "num_heldout": counts["num_heldout"], **totals}
    return counts


@dataclass
class EstimateRow:
    label: str
    storage_dtype: str
    layout: str
    bytes_per_token: int
    total_bytes: int | None


@dataclass
class EstimateReport:
    """What ``deepspec estimate`` computed (also printed as a table)."""

    config_path: str
    hidden_size: int
    num_hidden_layers: int
    num_target_layers: int
    num_tokens: int | None
    token_source: str
    rows: list[EstimateRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_estimate(cfg: EstimateConfig, *, tokenizer: Any = None, log=print) -> EstimateReport:
    """Compute and print the size table for ``cfg``; ``tokenizer`` defaults to the target's.

    Raises FileNotFoundError / ValueError for a missing config or input, or invalid layer ids.
    """
    tcfg, path = read_target_config(cfg.target)
    H, L = int(tcfg["hidden_size"]), int(tcfg["num_hidden_layers"])
    if cfg.target_layer_ids is not None:
        layer_ids = validate_target_layer_ids(cfg.target_layer_ids, L)
    else:
        layer_ids = default_target_layer_ids(L, cfg.num_target_layers)
    n = len(layer_ids)

    num_tokens: int | None
    if cfg.input is not None:
        if tokenizer is None:
            if cfg.target == "default":
                tokenizer = load_tokenizer("default")
            else:
                tokenizer = _load_folder_tokenizer(path.parent)
        c = count_prepared_tokens(cfg.input, tokenizer, max_seq_len=cfg.max_seq_len)
        num_tokens = c["num_tokens"]
        source = (f"measured from {cfg.input}: {c['num_rows']:,} rows ({c['num_heldout']:,} held out), "
                  f"{c['num_samples']:,} samples, {num_tokens:,} tokens (max_seq_len {cfg.max_seq_len})")
    elif cfg.num_tokens is not None:
        num_tokens = int(cfg.num_tokens)
        source = f"given: {num_tokens:,} tokens"
    elif cfg.num_conversations is not None:
        num_tokens = int(round(cfg.num_conversations * cfg.tokens_per_conversation))
        source = (f"given: {cfg.num_conversations:,} conversations x {cfg.tokens_per_conversation:,g} "
                  f"tokens/conversation = {num_tokens:,} tokens")
    else:
        num_tokens = None
        source = "no dataset size given (--input, --num-tokens or --num-conversations x --tokens-per-conversation)"

    report = EstimateReport(str(path), H, L, n, num_tokens, source)
    labels = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
              "fp8": "fp8 (e4m3 + f32 scale/token/layer; bf16 final hidden)"}
    for mode in STORAGE_DTYPES:
        bpt = cache_bytes_per_token(H, n, mode)
        report.rows.append(EstimateRow(labels[mode], mode, "deepspec", bpt,
                                       None if num_tokens is None else bpt * num_tokens))
    bpt = cache_bytes_per_token(H, n, "bfloat16", layout="original")
    report.rows.append(EstimateRow("original DeepSpec layout (bf16 + uint8 attention_mask)", "bfloat16", "original",
                                   bpt, None if num_tokens is None else bpt * num_tokens))

    log(f"target config {path}: hidden_size {H}, {L} decoder layers; {n} target layers {layer_ids}")
    log(f"dataset: {source}")
    width = max(len(r.label) for r in report.rows) + 2
    log(f"  {'storage':<{width}}{'bytes/token':>12}  {'total':>22}")
    for r in report.rows:
        mark = "*" if r.layout == "deepspec" and r.storage_dtype == cfg.storage_dtype else " "
        total = "-" if r.total_bytes is None else format_bytes(r.total_bytes)
        log(f"{mark} {r.label:<{width}}{r.bytes_per_token:>12,}  {total:>22}")
    log("(* = --storage-dtype; per-sample offsets (8 B/sample) and shard headers not included; "
        "binary units: 1 MiB = 2^20 bytes, 1 TiB = 2^40 bytes)")
    return report
