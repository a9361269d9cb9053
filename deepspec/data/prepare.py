"""Prepare stage: normalise conversations and regenerate their assistant turns with the target.

docs/design/data.md, "Regeneration": every assistant turn is replaced by the target's own answer, turn by turn with the
regenerated history, so the draft learns the target's distribution (not the source model's).
Backends (:mod:`deepspec.data.backends`): ``local`` (the target in-process, batched with left
padding) and ``openai`` (OpenAI-compatible servers: vLLM, SGLang, ``deepspec serve``).

Counting contract: ``read == kept + skipped + failed`` (printed, and in the summary JSON); skipped
and failed rows are listed in ``<stem>.skipped.jsonl`` beside the output, one JSON line each:
``{"source_index", "id", "where", "status": "skipped" | "failed", "reason"}``, where ``where`` is
the row's location (``file.jsonl:12`` 1-based line, ``file.json[3]`` / ``file.parquet[3]``
0-based row, the file inside a folder input named in full, ``org/name:train[3]``,
``sharegpt-demo[3]``). The console shows the first :data:`NUM_SKIPPED_SHOWN` of them, and a
warning when no conversation is kept (the exit status stays 0: the outputs are written, empty).
``lost_in_source`` counts records the source itself lost (the ShareGPT V3 demo file is cut
mid-record), which were never read; printed only when nonzero.

Outputs (JSONL, input order). ``output`` must be a file path (a folder is refused at config
time); its parent folder is created when missing. All outputs are written under temporary names
first and renamed only when all are complete, the train file first, so a failed write never leaves
side files under their final names:

- ``<output>``: the ``train`` rows; ``<stem>.heldout.jsonl``: the ``heldout`` rows (always written,
  empty when ``heldout_fraction == 0``). The split is :func:`deepspec.data.sources.assign_split` of
  the row key (its id, else its source index), so neither order nor resume changes it, and the
  cache stage reads the train file only. Each row::

    {"id": str, "source_index": int, "messages": [{"role", "content"}, ...],
     "generated_ids": [null | [int, ...] per message] (only when some turn has ids),
     "truncated": bool, "truncated_turns": [message indices of answers cut by max_new_tokens],
     "chat_template_kwargs": {...} (only when set, e.g. {"enable_thinking": false}),
     "split": "train" | "heldout"}

  ``generated_ids[i]`` holds, for a regenerated assistant turn ``i``, the token ids the target
  generated, exactly: its stop token last unless the turn was cut (the local backend always; an
  OpenAI-compatible server when it returns them, see :class:`~deepspec.data.backends.OpenAIBackend`),
  and null for other messages and for turns a server answered with text only. The cache and online
  mode supervise exactly these ids (:func:`deepspec.data.chat.render_training_samples`). The
  message ``content`` is the decoded answer (stop token removed, not stripped): it is the history
  the next turn's prompt is rendered from, as the target was given it. Rows without
  ``generated_ids`` (written before the field existed, or imported) are text only.

- ``<output>.summary.json``: the config (no API key: only ``api_key_env``), the counts (turns with
  and without generated ids included), ``decoding`` (every decoding setting, the stop token ids,
  and the target's own generation-config settings that were ignored:
  :func:`deepspec.target.decoding.decoding_record`) and ``render`` (what the chat template read:
  :func:`deepspec.data.chat.render_record`, compared when the cache is built); after a resume,
  ``resumed_render`` (the render the journal's rows were made with, equal to ``render``).

Resume (``<output>.partial.jsonl``, the journal): its first line records the settings that shape
the answers and their hash; every finished conversation (kept or failed) is appended as one line,
keyed by ``source_index``, then flushed and fsynced. A run killed at any moment (SIGKILL included,
even mid-line) leaves at worst one torn last line, which the next run ignores and cuts off. The
next run with the same settings re-reads the source, takes finished rows from the journal (checking
their id and a hash of their source messages), regenerates only the missing ones, then writes the
outputs atomically in input order and deletes the journal. No row is duplicated or skipped; with
greedy decoding the outputs are byte-identical to an uninterrupted run. A run with other settings
is refused (the message lists the differences). The settings include the render record (everything
the chat template reads at render time: its hash, kwargs, stop ids, the probe's ids, and the date
when it reads ``strftime_now``): a run resumed with another template, or on another day with a
template that reads the date, is refused, since its rows would pair answers with prompts the target
never saw. Settings that do not change answers (batch size, servers, concurrency, retries, held-out
fraction) may change between runs.

Choices (documented for users):
- ``max_turns`` caps the assistant turns regenerated per conversation (the rest of the
  conversation is dropped); the CPU demo uses 1.
- A conversation ending on a user turn loses that trailing user turn: the source has no answer to
  it, and regeneration replaces answers, it does not extend conversations.
- A conversation stops at the last assistant turn whose prompt fits in ``max_prompt_tokens``; if the
  first one does not fit, the row is skipped (reason recorded). The local tokenizer (``target``)
  measures prompts for both backends, so it must be the served target's tokenizer.
- A conversation also stops after an answer cut by ``max_new_tokens`` (later turns would be
  conditioned on an answer the target never finished); the cut answer is kept and flagged in
  ``truncated_turns``. The training render (:func:`deepspec.data.chat.render_training_samples` with
  ``cut_turns=truncated_turns``) then leaves its end-of-turn token out of the loss mask: the
  template writes one there, but the target never produced it.
- Regenerated answers are stored as generated: never stripped (the ids are kept as well, so the
  supervised tokens are the target's own even where the text does not re-tokenise to them).
- Decoding is pinned (:mod:`deepspec.target.decoding`): greedy or temperature + ``top_k`` +
  ``top_p``, nothing else, whatever the target's ``generation_config.json`` says; generation stops
  on the one stop rule (:func:`deepspec.data.chat.stop_token_ids`), for both backends.
- A server that refuses one row as invalid (HTTP 400/422, e.g. longer than its context) makes that
  row ``failed`` (reason recorded) when ``skip_bad_rows``; connection errors, timeouts, 429 and 5xx
  are retried ``max_retries`` times with exponential backoff, then stop the run (the journal keeps
  finished rows).
- Conversations are regenerated ``chunk_conversations`` at a time, round by round inside a chunk
  (round k = the k-th assistant turn of every unfinished conversation); a kill loses at most the
  unfinished conversations of one chunk. Sampling seeds are per request:
  ``sha256(seed/source_index/turn)``, honoured by servers that support ``seed``; the local backend
  seeds each batch with its first request's seed, so only greedy local answers are independent of
  batch composition.

Measured speed (embedded SmolLM2-135M, fp32, 2 CPU cores shared with other jobs, ShareGPT demo,
``max_turns=1``, ``max_prompt_tokens=256``, ``max_new_tokens=128``, prefill included): batch 16:
65 tok/s, batch 32: 78 tok/s; about 105 generated tokens per conversation (72 % hit the limit:
SmolLM2 answers at length). Batched output is token-identical to batch 16 vs 32 (left padding is
exact in fp32).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.data.backends import (
    BackendError,
    GenerationParams,
    LocalBackend,
    OpenAIBackend,
    RegenerationBackend,
    TurnRequest,
    TurnResult,
)
from deepspec.data.chat import (
    generation_eos_of,
    render_prompt,
    render_record,
    render_record_differences,
    stop_token_ids,
)
from deepspec.data.conversations import SkipRow
from deepspec.data.sources import ID_FIELDS, assign_split, open_source, row_key, source_row_messages
from deepspec.device import check_device_name, check_dtype_name, dtype_name, resolve_device, resolve_dtype
from deepspec.target.decoding import SamplingParams, decoding_record
from deepspec.target.load import load_generation_config, load_target, load_tokenizer, require_chat_template
from deepspec.utils import atomic_path, atomic_write_text

SHAREGPT_DEMO = "sharegpt-demo"
NUM_SKIPPED_SHOWN = 5  # skipped/failed rows listed on the console (all of them are in <stem>.skipped.jsonl)
BACKENDS = ("local", "openai")
JOURNAL_FORMAT = "deepspec-prepare-journal/1"


def _render_errors() -> tuple[type[BaseException], ...]:
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - jinja2 is a dependency of chat templates
        return (ValueError,)
    return (ValueError, TemplateError)


_RENDER_ERRORS = _render_errors()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(kw_only=True)
class PrepareConfig:
    """Settings of the prepare stage (see the module docstring for the rules).

    Raises:
        ValueError: naming the field, for any invalid value.
    """

    input: str  # "sharegpt-demo", a .jsonl/.json/.parquet file or folder, or a Hugging Face dataset id
    output: Path  # train rows; beside it <stem>.heldout.jsonl, <stem>.skipped.jsonl, <output>.summary.json
    num_conversations: int | None = None  # conversations to keep (the first usable ones, in input order); None = all
    max_new_tokens: int = 128  # per regenerated answer; answers that hit it are flagged truncated
    batch_size: int = 32  # local backend: conversations generated together (left padding)
    max_prompt_tokens: int = 512  # a turn whose prompt is longer ends the conversation (first turn: row skipped)
    max_turns: int | None = None  # assistant turns regenerated per conversation; None (`--max-turns none`) = all
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # top-k sampling (used only when temperature > 0); 0 = off
    top_p: float = 1.0  # nucleus sampling (used only when temperature > 0)
    skip_bad_rows: bool = True  # false: the first unusable row stops the run with an error naming it
    seed: int = 0  # sampling seed (per request: derived from seed, row and turn)
    sort_window: int | None = None  # local backend: jobs sorted by prompt length per window; None = whole round
    target: str = "default"  # model (local) / tokenizer for prompt lengths (both backends); a folder or a GGUF file
    # a Jinja chat template file replacing the target's, or a built-in name (gemma3);
    # GGUF files often carry none (docs/guide/targets.md, "Chat templates")
    chat_template: str | None = None
    # local backend: the target's dtype for generation: auto (bfloat16 on CUDA or a CPU with
    # AVX512-BF16/AMX, else float32) | float32 | bfloat16 (aliases fp32, bf16)
    dtype: str = "auto"
    # local backend: where the target generates: auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu |
    # cuda | cuda:N (deepspec.device.resolve_device)
    device: str = "auto"
    hf_split: str = "train"  # split of a Hugging Face dataset input
    enable_thinking: bool | None = None  # passed to the chat template (Qwen3); None = template default
    heldout_fraction: float = 0.0  # rows held out (by assign_split) into <stem>.heldout.jsonl
    split_seed: int = 0  # seed of the train/held-out hash split
    backend: str = "local"  # "local" | "openai"
    base_urls: list[str] = field(default_factory=list)  # openai: e.g. http://host:8000/v1 (several allowed)
    server_model: str | None = None  # openai: served model name; None = the single model of /v1/models
    api_key_env: str = "OPENAI_API_KEY"  # openai: environment variable holding the API key ("EMPTY" if unset)
    max_concurrency: int = 8  # openai: requests in flight per server
    max_retries: int = 5  # openai: retries per request (connection errors, timeouts, 429, 5xx)
    retry_backoff_s: float = 1.0  # openai: first retry delay, doubled each retry (jittered, <= 60 s)
    request_timeout_s: float = 600.0  # openai: per request
    chunk_conversations: int = 1024  # conversations regenerated together (round by round) before the next
    show_progress: bool = True  # progress bar

    def __post_init__(self) -> None:
        raw_output = str(self.output) if isinstance(self.output, (str, os.PathLike)) else ""
        if not raw_output.strip():
            raise ValueError(f"PrepareConfig.output={self.output!r}: expected a file path such as data/train.jsonl.")
        self.output = Path(raw_output).expanduser()
        if raw_output.endswith(("/", os.sep)) or self.output.is_dir():
            raise ValueError(f"PrepareConfig.output={raw_output!r}: expected a file path, got a folder; name the "
                             f"train file inside it, e.g. --output {self.output / 'train.jsonl'} (the side files "
                             f"<stem>.heldout.jsonl, <stem>.skipped.jsonl and <output>.summary.json go beside it).")
        parent = self.output.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"PrepareConfig.output={raw_output!r}: {parent} is a file, so the output folder "
                             f"{self.output.parent} cannot be created; choose another --output path.")
        positive = {"max_new_tokens": self.max_new_tokens,
                    "batch_size": self.batch_size, "max_prompt_tokens": self.max_prompt_tokens,
                    "max_concurrency": self.max_concurrency, "chunk_conversations": self.chunk_conversations}
        if self.num_conversations is not None:
            positive["num_conversations"] = self.num_conversations
        if self.max_turns is not None:
            positive["max_turns"] = self.max_turns
        if self.sort_window is not None:
            positive["sort_window"] = self.sort_window
        for name, value in positive.items():
            if not _is_int(value) or value <= 0:
                raise ValueError(f"PrepareConfig.{name}={value!r}: expected a positive integer.")
        for name in ("seed", "split_seed"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"PrepareConfig.{name}={getattr(self, name)!r}: expected an integer.")
        if not _is_int(self.max_retries) or self.max_retries < 0:
            raise ValueError(f"PrepareConfig.max_retries={self.max_retries!r}: expected an integer >= 0.")
        if not isinstance(self.hf_split, str) or not self.hf_split.strip():
            raise ValueError(f"PrepareConfig.hf_split={self.hf_split!r}: expected a split name such as 'train'.")
        if not isinstance(self.input, str) or not self.input.strip():
            raise ValueError(f"PrepareConfig.input={self.input!r}: expected {SHAREGPT_DEMO!r}, a .jsonl/.json/.parquet "
                             f"file or folder, or a Hugging Face dataset id 'org/name[:split]'.")
        if not (self.temperature >= 0.0):
            raise ValueError(f"PrepareConfig.temperature={self.temperature!r}: expected >= 0 (0 = greedy).")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"PrepareConfig.top_k={self.top_k!r}: expected an integer >= 0 (0 = off).")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"PrepareConfig.top_p={self.top_p!r}: expected a number in (0, 1] (1 = no nucleus cut).")
        if not (0.0 <= self.heldout_fraction < 1.0):
            raise ValueError(f"PrepareConfig.heldout_fraction={self.heldout_fraction!r}: expected a number in [0, 1) "
                             f"(0.01 holds out about 1 % of the rows).")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise ValueError(f"PrepareConfig.enable_thinking={self.enable_thinking!r}: expected true, false or None.")
        if not (self.request_timeout_s > 0):
            raise ValueError(f"PrepareConfig.request_timeout_s={self.request_timeout_s!r}: expected a number > 0.")
        if not (self.retry_backoff_s >= 0):
            raise ValueError(f"PrepareConfig.retry_backoff_s={self.retry_backoff_s!r}: expected a number >= 0.")
        if self.backend not in BACKENDS:
            raise ValueError(f"PrepareConfig.backend={self.backend!r}: expected one of {BACKENDS}.")
        self.dtype = check_dtype_name(self.dtype, "PrepareConfig.dtype")
        self.device = check_device_name(self.device, "PrepareConfig.device")
        self.base_urls = list(self.base_urls)
        if self.backend == "openai":
            if not self.base_urls:
                raise ValueError("PrepareConfig.base_urls: backend='openai' needs at least one server URL, "
                                 "e.g. --base-urls http://host:8000/v1 http://host2:8000/v1.")
            for url in self.base_urls:
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"PrepareConfig.base_urls: {url!r} is not an http(s) URL "
                                     f"(expected e.g. http://host:8000/v1).")
            if len(set(self.base_urls)) != len(self.base_urls):
                raise ValueError(f"PrepareConfig.base_urls={self.base_urls}: a URL is listed twice "
                                 f"(raise max_concurrency instead).")
        elif self.base_urls:
            raise ValueError(f"PrepareConfig.base_urls={self.base_urls}: only used with backend='openai' "
                             f"(got backend={self.backend!r}).")
        if self.server_model is not None and not self.server_model.strip():
            raise ValueError("PrepareConfig.server_model: expected a model name or None (ask /v1/models).")
        if not isinstance(self.api_key_env, str) or not self.api_key_env.strip():
            raise ValueError(f"PrepareConfig.api_key_env={self.api_key_env!r}: expected an environment variable name.")

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template receives besides the messages (None when nothing is set)."""
        return None if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


@dataclass(kw_only=True)
class PrepareSummary:
    """Counts of one prepare run. ``read == kept + skipped + failed``; ``kept == num_train + num_heldout``.

    ``num_resumed`` rows came from the journal of an interrupted run; the generation figures
    (turns, tokens, seconds) count this run's work only.
    """

    read: int  # rows examined
    kept: int
    skipped: int
    failed: int
    truncated: int  # kept rows with at least one answer cut by max_new_tokens
    lost_in_source: int  # records the source file itself lost (not read)
    num_train: int = 0
    num_heldout: int = 0
    num_resumed: int = 0
    num_retries: int = 0  # openai backend: retried requests
    num_regenerated_turns: int = 0
    num_turns_with_ids: int = 0  # regenerated turns whose generated token ids are stored
    num_turns_text_only: int = 0  # regenerated turns a server answered with text only (no ids)
    num_generated_tokens: int = 0
    generate_s: float = 0.0
    backend: str = "local"
    model_dtype: str | None = None  # local backend: the dtype the answers were generated in
    model_device: str | None = None  # local backend: the device they were generated on
    output: str = ""
    heldout_path: str = ""
    skipped_path: str = ""

    @property
    def tok_per_s(self) -> float:
        return self.num_generated_tokens / self.generate_s if self.generate_s > 0 else 0.0


def _stem(output: Path) -> str:
    return output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name


def skipped_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.skipped.jsonl`` (the list of skipped/failed rows with reasons)."""
    output = Path(output)
    return output.with_name(_stem(output) + ".skipped.jsonl")


def heldout_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.heldout.jsonl`` (the rows that :func:`assign_split` holds out)."""
    output = Path(output)
    return output.with_name(_stem(output) + ".heldout.jsonl")


def summary_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.jsonl.summary.json`` (config, counts, decoding and render records)."""
    output = Path(output)
    return output.with_name(output.name + ".summary.json")


def journal_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.jsonl.partial.jsonl`` (the resume journal; deleted when the run completes)."""
    output = Path(output)
    return output.with_name(output.name + ".partial.jsonl")


@dataclass
class _Conversation:
    source_index: int
    row_id: str
    split_key: str
    where: str  # location and id, for messages: "data.jsonl:3 (id a1)"
    location: str  # location alone, for the skipped file: "data.jsonl:3", "data.parquet[2]", "org/name:train[2]"
    source: list[dict[str, str]]  # normalised, cut to max_turns assistant turns
    assistant_positions: list[int]
    history: list[dict[str, str]] = field(default_factory=list)  # regenerated so far (ends after an answer)
    next_turn: int = 0  # index into assistant_positions
    done: bool = False
    truncated_turns: list[int] = field(default_factory=list)
    generated: dict[int, list[int]] = field(default_factory=dict)  # message index -> generated ids
    failure: str | None = None  # reason, when regeneration failed for this row

    @property
    def source_sha(self) -> str:
        return hashlib.sha256(json.dumps(self.source, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def _cut_to_turns(messages: list[dict[str, str]], max_turns: int | None) -> list[dict[str, str]]:
    """Keep messages up to the ``max_turns``-th assistant turn (all when None); drop a trailing user tail."""
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if max_turns is not None:
        positions = positions[:max_turns]
    return messages[: positions[-1] + 1]


def _row_id(row: Any, source_index: int, cfg: PrepareConfig) -> str:
    if isinstance(row, dict):
        for name in ID_FIELDS:
            value = row.get(name)
            if (isinstance(value, str) and value.strip()) or _is_int(value):
                return str(value)
    return f"{Path(str(cfg.input).rstrip('/')).stem}-{source_index}"


def _select(cfg: PrepareConfig, tokenizer: Any, skipped: list[dict[str, Any]]) -> tuple[list[_Conversation], int, int]:
    """First ``num_conversations`` usable rows. Returns (conversations, rows_read, lost_in_source)."""
    source = open_source(cfg.input, hf_split=cfg.hf_split, skip_unreadable=cfg.skip_bad_rows)
    convs: list[_Conversation] = []
    read = 0
    for located in source.located:
        if cfg.num_conversations is not None and len(convs) >= cfg.num_conversations:
            break
        read += 1
        source_index, row = located.index, located.row
        row_id = _row_id(row, source_index, cfg)
        where = f"{located.where} (id {row_id})"
        try:
            messages = _cut_to_turns(source_row_messages(located), cfg.max_turns)
            positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            prompt_len = len(render_prompt(tokenizer, messages[: positions[0]],
                                           chat_template_kwargs=cfg.chat_template_kwargs))
            if prompt_len > cfg.max_prompt_tokens:
                raise SkipRow(f"first prompt has {prompt_len} tokens > max_prompt_tokens={cfg.max_prompt_tokens} "
                              f"(--max-prompt-tokens)",
                              where=where)
        except SkipRow as exc:
            if not cfg.skip_bad_rows:
                raise ValueError(f"{where}: {exc.reason} (pass --skip-bad-rows true (skip_bad_rows=True) to skip "
                                 f"and count such rows)") from None
            skipped.append({"source_index": source_index, "id": row_id, "where": located.where, "status": "skipped",
                            "reason": exc.reason})
            continue
        except _RENDER_ERRORS as exc:  # the chat template refused the conversation
            if not cfg.skip_bad_rows:
                raise ValueError(f"{where}: chat template failed: {exc}") from exc
            skipped.append({"source_index": source_index, "id": row_id, "where": located.where, "status": "failed",
                            "reason": f"chat template failed: {exc}"})
            continue
        convs.append(_Conversation(source_index=source_index, row_id=row_id, split_key=row_key(row, source_index),
                                   where=where, location=located.where, source=messages,
                                   assistant_positions=positions))
    return convs, read, source.num_lost


def _request_seed(seed: int, source_index: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}/{source_index}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------- journal


def _journal_settings(cfg: PrepareConfig, model_name: str, stop_ids: list[int],
                      model_dtype: str | None = None, render: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings that shape which rows are read and what the answers are (resume must match them);
    ``model_dtype``: the local target's resolved dtype (answers differ between float32 and bfloat16);
    ``render``: the render record (:func:`deepspec.data.chat.render_record`: everything the chat template
    reads at render time, the date included when it reads ``strftime_now``), as the prompts are rendered."""
    keys = ("input", "hf_split", "num_conversations", "max_new_tokens", "max_prompt_tokens", "max_turns",
            "temperature", "top_k", "top_p", "seed", "enable_thinking", "target", "backend")
    settings = {k: getattr(cfg, k) for k in keys}
    settings["model"] = model_name
    settings["stop_token_ids"] = list(stop_ids)
    if model_dtype is not None:
        settings["model_dtype"] = model_dtype
    if render is not None:
        settings["render"] = dict(render)
    return settings


def _render_changes(old: Any, new: dict[str, Any]) -> list[str]:
    """Why the render recorded in a journal header differs from this run's, as readable lines (empty:
    same). Unlike :func:`deepspec.data.chat.render_record_differences`, another ``render_date`` is a
    difference: a template that reads today's date may print it only in rows the probe does not cover."""
    if not isinstance(old, dict):
        return ["the journal records no render (written by an older deepspec), so its rows cannot be checked"]
    lines = render_record_differences(old, new)
    if old.get("render_date") != new.get("render_date") and not any("strftime_now" in line for line in lines):
        lines.append(f"the chat template reads strftime_now (today's date): the journal's rows were rendered on "
                     f"{old.get('render_date', '?')}, this run renders on {new.get('render_date', '?')}")
    if not lines and old != new:
        lines = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                 if old.get(k) != new.get(k)]
    return lines


def _settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def read_journal(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Read a prepare journal; cut off a torn last line (a kill mid-write) in place.

    Returns:
        ``(header, entries)``; ``(None, [])`` when the file is missing, empty, or holds only a torn
        header (the caller starts afresh).

    Raises:
        ValueError: a malformed line that is not the last one, or a first line that is not a
            journal header (the file is not a prepare journal: move it away).
    """
    path = Path(path)
    if not path.is_file():
        return None, []
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1  # bytes up to the end of the last complete line
    if complete < len(data):  # a torn last line: ignore it and cut it off so appends start on a new line
        with path.open("r+b") as f:
            f.truncate(complete)
            f.flush()
            os.fsync(f.fileno())
    lines = data[:complete].decode("utf-8").splitlines()
    if not lines:
        return None, []
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != JOURNAL_FORMAT:
        raise ValueError(f"{path}: the first line is not a {JOURNAL_FORMAT} header; this file is not a prepare "
                         f"journal. Move it away (or delete it to start over).")
    entries = []
    for line_no, line in enumerate(lines[1:], start=2):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: malformed journal line ({exc.msg}); only the last line can be torn "
                             f"by a kill. Delete the journal to start over.") from None
    return header, entries


class _Journal:
    """Append-only record of finished conversations (one JSON line each, fsynced)."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        header, self.entries = read_journal(path)
        wanted = _settings_hash(settings)
        if header is None:
            header = {"format": JOURNAL_FORMAT, "settings_hash": wanted, "settings": settings}
            atomic_write_text(path, json.dumps(header, sort_keys=True) + "\n")
            self.entries = []
        elif header.get("settings_hash") != wanted:
            old = header.get("settings", {})
            diff = {k: (old.get(k), settings.get(k)) for k in sorted(set(old) | set(settings))
                    if old.get(k) != settings.get(k) and k != "render"}
            listed = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
            render_lines = _render_changes(old.get("render"), settings["render"]) if "render" in settings else []
            if render_lines:
                listed.append("the chat template renders differently (" + "; ".join(render_lines) + ")")
            fix = f"Rerun with the same settings to resume, or delete {path} to start over."
            if render_lines:
                fix = (f"The journal's answers were generated for prompts rendered as it records; resuming would "
                       f"write rows of two renderings into one file, pairing answers with prompts the target never "
                       f"saw. Resume with the target, --chat-template and --enable-thinking of the interrupted run "
                       f"(a template that prints today's date resumes only on the day the run started: no setting "
                       f"pins the date), or delete {path} to start over.")
            raise ValueError(f"{path} holds an interrupted prepare run with other settings "
                             f"({', '.join(listed) or 'unknown difference'}). {fix}")
        self.header = header
        self._file = path.open("a", encoding="utf-8")

    def append(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _out_row(conv: _Conversation, cfg: PrepareConfig) -> dict[str, Any]:
    row: dict[str, Any] = {"id": conv.row_id, "source_index": conv.source_index, "messages": conv.history,
                           "truncated": bool(conv.truncated_turns), "truncated_turns": conv.truncated_turns}
    if conv.generated:
        row["generated_ids"] = [conv.generated.get(i) for i in range(len(conv.history))]
    if cfg.chat_template_kwargs is not None:
        row["chat_template_kwargs"] = cfg.chat_template_kwargs
    return row


def _restore(convs: list[_Conversation], entries: list[dict[str, Any]], journal_path: Path) -> int:
    """Mark the conversations the journal finished; returns how many. Raises ValueError on a mismatch."""
    by_index = {c.source_index: c for c in convs}
    restored = 0
    for entry in entries:
        conv = by_index.get(entry.get("source_index"))
        if conv is None or entry.get("id") != conv.row_id or entry.get("source_sha") != conv.source_sha:
            raise ValueError(
                f"{journal_path}: row {entry.get('source_index')} (id {entry.get('id')!r}) does not match the source "
                f"as read now (the input changed since the interrupted run). Delete the journal to start over.")
        if conv.done:
            continue  # a duplicate line (cannot happen with one writer); the first one wins
        conv.done = True
        if entry["status"] == "failed":
            conv.failure = entry["reason"]
        else:
            row = entry["row"]
            conv.history, conv.truncated_turns = row["messages"], row["truncated_turns"]
            conv.generated = {i: ids for i, ids in enumerate(row.get("generated_ids") or []) if ids is not None}
        restored += 1
    return restored


# ----------------------------------------------------------------------------------------------- run


def _make_backend(cfg: PrepareConfig, model: Any, tokenizer: Any, log: Callable[[str], None],
                  stop_ids: list[int]) -> RegenerationBackend:
    if cfg.backend == "local":
        return LocalBackend(model, tokenizer, batch_size=cfg.batch_size, sort_window=cfg.sort_window,
                            stop_token_ids=stop_ids)
    return OpenAIBackend(cfg.base_urls, model=cfg.server_model, api_key=os.environ.get(cfg.api_key_env) or "EMPTY",
                         max_concurrency=cfg.max_concurrency, max_retries=cfg.max_retries,
                         request_timeout_s=cfg.request_timeout_s, retry_backoff_s=cfg.retry_backoff_s, log=log,
                         stop_token_ids=stop_ids, eos_token_id=tokenizer.eos_token_id)


def _target_generation_config(cfg: PrepareConfig, model: Any) -> Any:
    """The target's generation config: the loaded model's, else the one in the ``cfg.target`` folder
    (backend "openai" loads only the tokenizer); read for its eos ids and recorded as ignored."""
    if model is not None:
        return getattr(model, "generation_config", None)
    return load_generation_config(cfg.target)


def run_prepare(cfg: PrepareConfig, model: Any = None, tokenizer: Any = None, *,
                backend: RegenerationBackend | None = None,
                log: Callable[[str], None] = print) -> PrepareSummary:
    """Run the prepare stage; write the outputs listed in the module docstring atomically.

    Args:
        cfg: the stage settings.
        model, tokenizer: the target. ``backend="local"``: both loaded from ``cfg.target`` when
            omitted. ``backend="openai"``: only the tokenizer is used (prompt lengths), loaded from
            ``cfg.target`` when omitted.
        backend: a ready backend (tests); built from ``cfg`` when None.
        log: where progress lines go.

    Returns:
        The counts (``read == kept + skipped + failed``) and generation speed.

    Raises:
        ValueError: an unusable input, an unusable row with ``skip_bad_rows=False``, or a journal
            written with other settings / for another input.
        deepspec.data.backends.BackendError: a server kept failing after retries (or refused a row
            with ``skip_bad_rows=False``). Exceptions from generation propagate; finished rows stay
            in the journal and nothing is written under the final output names.
    """
    from tqdm.auto import tqdm

    target = _target_and_backend(cfg, model, tokenizer, backend, log)
    tokenizer, backend, stop_ids = target.tokenizer, target.backend, target.stop_ids
    torch.manual_seed(cfg.seed)
    decoding = decoding_record(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                               top_p=cfg.top_p, stop_token_ids=stop_ids,
                               checkpoint_generation_config=target.generation_config)
    render = render_record(tokenizer, chat_template_kwargs=cfg.chat_template_kwargs, stop_ids=stop_ids)

    skipped: list[dict[str, Any]] = []
    convs, read, lost_in_source = _select(cfg, tokenizer, skipped)
    model_name = backend.resolve_model() if isinstance(backend, OpenAIBackend) else cfg.target
    journal = _Journal(journal_path_for(cfg.output),
                       _journal_settings(cfg, model_name, stop_ids, target.model_dtype, render=render))
    num_resumed = _restore(convs, journal.entries, journal.path)
    if num_resumed:
        log(f"prepare: resuming from {journal.path}: {num_resumed} of {len(convs)} conversations already finished")

    def finish(conv: _Conversation) -> None:
        conv.done = True
        entry: dict[str, Any] = {"source_index": conv.source_index, "id": conv.row_id, "source_sha": conv.source_sha}
        if conv.failure is not None:
            entry.update(status="failed", reason=conv.failure)
        else:
            entry.update(status="kept", row=_out_row(conv, cfg))
        journal.append(entry)

    pending = [c for c in convs if not c.done]
    counts = _TurnCounts()
    bar = tqdm(total=sum(len(c.assistant_positions) for c in pending), desc="regenerate turns", unit="turn",
               disable=not cfg.show_progress)
    try:
        _regenerate(cfg, tokenizer, backend, pending, finish, bar, counts)
    finally:
        bar.close()
        journal.close()
        backend.close()

    summary, train_rows, heldout_rows = _summarize(cfg, convs, skipped, counts, read=read,
                                                   lost_in_source=lost_in_source, num_resumed=num_resumed,
                                                   backend=backend, model_dtype=target.model_dtype,
                                                   model_device=target.model_device)
    # The render of the resumed rows, checked equal to this run's by _Journal: recorded so that the cache
    # can tell a resumed file that was checked from one written before the check existed.
    resumed_render = journal.header.get("settings", {}).get("render") if num_resumed else None
    _write_outputs(cfg, summary, skipped, train_rows, heldout_rows, decoding=decoding, render=render,
                   resumed_render=resumed_render)
    journal.path.unlink()  # every output is in place: the journal has served its purpose
    _log_summary(cfg, summary, skipped, counts, log)
    return summary


@dataclass
class _Target:
    """What ``run_prepare`` regenerates with: the tokenizer, the backend, the stop ids, the target's
    generation config, and the local model's dtype and device (None for a server: not known here)."""

    tokenizer: Any
    backend: RegenerationBackend
    stop_ids: list[int]
    generation_config: Any
    model_dtype: str | None
    model_device: str | None


def _target_and_backend(cfg: PrepareConfig, model: Any, tokenizer: Any, backend: RegenerationBackend | None,
                        log: Callable[[str], None]) -> _Target:
    """Load what ``run_prepare`` was not given (the target or only its tokenizer, as its docstring says),
    check the chat template, read the stop ids and build the backend (a given OpenAI backend without
    stop ids gets the target's)."""
    if backend is None and cfg.backend == "local" and (model is None or tokenizer is None):
        device = resolve_device(cfg.device, "PrepareConfig.device")
        model, tokenizer = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=device,
                                       chat_template=cfg.chat_template)
    elif tokenizer is None:
        tokenizer = load_tokenizer(cfg.target, chat_template=cfg.chat_template)
    require_chat_template(tokenizer, cfg.target)
    generation_config = _target_generation_config(cfg, model)
    stop_ids = stop_token_ids(tokenizer, generation_eos=generation_eos_of(generation_config))
    if backend is None:
        backend = _make_backend(cfg, model, tokenizer, log, stop_ids)
    elif isinstance(backend, OpenAIBackend) and not backend.stop_token_ids:
        backend.stop_token_ids, backend.eos_token_id = stop_ids, tokenizer.eos_token_id
    # the dtype the answers are generated in (local backend; a server's own is not known here)
    model_dtype = dtype_name(model.dtype) if cfg.backend == "local" and isinstance(getattr(model, "dtype", None),
                                                                              torch.dtype) else None
    model_device = (str(model.device) if model_dtype is not None and isinstance(getattr(model, "device", None),
                                                                               torch.device) else None)
    return _Target(tokenizer, backend, stop_ids, generation_config, model_dtype, model_device)


@dataclass
class _TurnCounts:
    """The regenerated turns, their tokens, the turns whose token ids came back, and the generation time."""

    num_tokens: int = 0
    num_turns: int = 0
    num_with_ids: int = 0
    generate_s: float = 0.0


def _regenerate(cfg: PrepareConfig, tokenizer: Any, backend: RegenerationBackend, pending: list[_Conversation],
                finish: Callable[[_Conversation], None], bar: Any, counts: _TurnCounts) -> None:
    """Regenerate the assistant turns of ``pending``, ``cfg.chunk_conversations`` conversations at a time,
    one round (the next turn of each unfinished conversation of the chunk) per backend call; each
    conversation ends through ``finish`` (kept, cut at the prompt limit, or failed). Adds to ``counts``.

    Raises:
        BackendError: a server refused a turn and ``cfg.skip_bad_rows`` is False.
    """
    ctk = cfg.chat_template_kwargs
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    for start in range(0, len(pending), cfg.chunk_conversations):
        chunk = pending[start:start + cfg.chunk_conversations]
        while True:
            # One round = the next assistant turn of every unfinished conversation of the chunk.
            jobs: list[tuple[_Conversation, list[dict[str, str]]]] = []
            for conv in chunk:
                if conv.done:
                    continue
                pos = conv.assistant_positions[conv.next_turn]
                begin = conv.assistant_positions[conv.next_turn - 1] + 1 if conv.next_turn else 0
                context = conv.history + conv.source[begin:pos]
                try:
                    prompt = render_prompt(tokenizer, context, chat_template_kwargs=ctk)
                except _RENDER_ERRORS as exc:
                    conv.failure = f"render failed at assistant turn {conv.next_turn}: {exc}"
                    bar.update(len(conv.assistant_positions) - conv.next_turn)
                    finish(conv)
                    continue
                if len(prompt) > cfg.max_prompt_tokens:
                    # Stop at the last turn that fits (the first one fits: checked in _select).
                    bar.update(len(conv.assistant_positions) - conv.next_turn)
                    finish(conv)
                    continue
                jobs.append((conv, context))
            if not jobs:
                break
            requests = [TurnRequest(
                key=f"{conv.where} assistant turn {conv.next_turn}", messages=context, chat_template_kwargs=ctk,
                generation=GenerationParams(max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                                            seed=_request_seed(cfg.seed, conv.source_index, conv.next_turn)),
            ) for conv, context in jobs]

            def on_result(i: int, result: TurnResult) -> None:
                conv, context = jobs[i]
                remaining = len(conv.assistant_positions) - conv.next_turn
                if result.refused:
                    if not cfg.skip_bad_rows:
                        raise BackendError(f"{requests[i].key}: {result.refused} (pass --skip-bad-rows true "
                                           f"(skip_bad_rows=True) to skip and count such rows)")
                    conv.failure, conv.history = f"server refused assistant turn {conv.next_turn}: " \
                                                 f"{result.refused}", []
                    bar.update(remaining)
                    finish(conv)
                    return
                counts.num_tokens += result.num_tokens
                counts.num_turns += 1
                conv.history = context + [{"role": "assistant", "content": result.text}]
                if result.token_ids is not None:
                    conv.generated[len(conv.history) - 1] = list(result.token_ids)
                    counts.num_with_ids += 1
                conv.next_turn += 1
                if result.cut:
                    conv.truncated_turns.append(len(conv.history) - 1)
                finished = result.cut or conv.next_turn >= len(conv.assistant_positions)
                bar.update(remaining if finished else 1)
                if finished:
                    finish(conv)
                seconds = counts.generate_s + time.perf_counter() - t0
                bar.set_postfix(tok_per_s=f"{counts.num_tokens / max(seconds, 1e-9):.0f}", refresh=False)

            t0 = time.perf_counter()
            backend.generate(requests, on_result)
            counts.generate_s += time.perf_counter() - t0


def _summarize(cfg: PrepareConfig, convs: list[_Conversation], skipped: list[dict[str, Any]], counts: _TurnCounts, *,
               read: int, lost_in_source: int, num_resumed: int, backend: RegenerationBackend,
               model_dtype: str | None, model_device: str | None,
               ) -> tuple[PrepareSummary, list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's counts and its train and held-out rows (input order; split by
    :func:`deepspec.data.sources.assign_split`). Adds the failed conversations to ``skipped`` and
    sorts it by source index."""
    kept = [c for c in convs if c.failure is None and c.history]  # convs is in input order
    failed_rows = [c for c in convs if c.failure is not None]
    assert all(c.done for c in convs) and len(kept) + len(failed_rows) == len(convs)
    skipped += [{"source_index": c.source_index, "id": c.row_id, "where": c.location, "status": "failed",
                 "reason": c.failure} for c in failed_rows]
    skipped.sort(key=lambda s: s["source_index"])
    train_rows, heldout_rows = [], []
    for c in kept:
        row = _out_row(c, cfg)
        row["split"] = assign_split(c.split_key, heldout_fraction=cfg.heldout_fraction, seed=cfg.split_seed)
        (heldout_rows if row["split"] == "heldout" else train_rows).append(row)

    num_tokens, num_turns = counts.num_tokens, counts.num_turns
    summary = PrepareSummary(
        read=read, kept=len(kept), skipped=sum(1 for s in skipped if s["status"] == "skipped"),
        failed=sum(1 for s in skipped if s["status"] == "failed"),
        truncated=sum(1 for c in kept if c.truncated_turns), lost_in_source=lost_in_source,
        num_train=len(train_rows), num_heldout=len(heldout_rows), num_resumed=num_resumed,
        num_retries=getattr(backend, "num_retries", 0),
        num_regenerated_turns=num_turns, num_generated_tokens=num_tokens, generate_s=round(counts.generate_s, 3),
        num_turns_with_ids=counts.num_with_ids, num_turns_text_only=num_turns - counts.num_with_ids,
        backend=cfg.backend, model_dtype=model_dtype, model_device=model_device, output=str(cfg.output),
        heldout_path=str(heldout_path_for(cfg.output)),
        skipped_path=str(skipped_path_for(cfg.output)),
    )
    assert summary.read == summary.kept + summary.skipped + summary.failed, summary
    return summary, train_rows, heldout_rows


def _write_outputs(cfg: PrepareConfig, summary: PrepareSummary, skipped: list[dict[str, Any]],
                   train_rows: list[dict[str, Any]], heldout_rows: list[dict[str, Any]], *,
                   decoding: dict[str, Any], render: dict[str, Any],
                   resumed_render: dict[str, Any] | None = None) -> None:
    """Write the summary, skipped, held-out and train files (module docstring), each atomically."""

    def rows_text(rows: list[dict[str, Any]]) -> str:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    cfg_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    record = {"config": cfg_dict, "summary": asdict(summary), "decoding": decoding, "render": render}
    if resumed_render is not None:
        record["resumed_render"] = resumed_render
    summary_text = json.dumps({**record, "tok_per_s": round(summary.tok_per_s, 1)}, indent=2, ensure_ascii=False) + "\n"
    # Every output is written under a temporary name first, then renamed: the train file first, the
    # side files after it (ExitStack exits in reverse order). If any write or the train file's
    # rename fails, no side file appears under its final name and the journal is kept.
    outputs = [(summary_path_for(cfg.output), summary_text),
               (skipped_path_for(cfg.output), rows_text(skipped)),
               (heldout_path_for(cfg.output), rows_text(heldout_rows)),
               (cfg.output, rows_text(train_rows))]
    with contextlib.ExitStack() as stack:
        for path, text in outputs:
            stack.enter_context(atomic_path(path)).write_text(text, encoding="utf-8")


def _log_summary(cfg: PrepareConfig, summary: PrepareSummary, skipped: list[dict[str, Any]], counts: _TurnCounts,
                 log: Callable[[str], None]) -> None:
    """The run's closing lines: the counts, the first skipped or failed rows with their reasons, and a
    warning when nothing was kept."""
    lost = (f"; {summary.lost_in_source} record{'s' * (summary.lost_in_source != 1)} lost in the source file itself "
            f"(never read; the ShareGPT V3 demo file is cut mid-record)" if summary.lost_in_source else "")
    log(f"prepare: read {summary.read} = kept {summary.kept} + skipped {summary.skipped} + failed {summary.failed} "
        f"(train {summary.num_train}, held out {summary.num_heldout}; resumed {summary.num_resumed}); "
        f"truncated {summary.truncated}{lost}; "
        f"{counts.num_turns} turns, {counts.num_tokens} tokens in {counts.generate_s:.1f} s "
        f"({summary.tok_per_s:.1f} tok/s) -> {cfg.output}")
    for entry in skipped[:NUM_SKIPPED_SHOWN]:
        log(f"prepare: {entry['status']} {entry['where']} (id {entry['id']}): {entry['reason']}")
    if len(skipped) > NUM_SKIPPED_SHOWN:
        log(f"prepare: ... {len(skipped) - NUM_SKIPPED_SHOWN} more in {summary.skipped_path}")
    elif skipped:
        log(f"prepare: every skipped/failed row with its reason: {summary.skipped_path}")
    if summary.kept == 0:
        log(f"prepare: warning: no conversation kept ({summary.read} read); see {summary.skipped_path} for the "
            f"reasons" if summary.read else "prepare: warning: no conversation kept: the input holds no rows")
