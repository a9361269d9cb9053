"""Prepare stage: normalise conversations and regenerate their assistant turns with the target.

DESIGN.md s.3: every assistant turn is replaced by the target's own answer, turn by turn with the
regenerated history, so the draft learns the target's distribution (not the source model's).
This module is the local backend (the target in-process, batched with left padding).

Counting contract: ``read == kept + skipped + failed``; skipped and failed rows are listed with
their reasons in ``<output stem>.skipped.jsonl`` beside the output. ``lost_in_source`` counts records
the source file itself lost (the ShareGPT V3 demo file is cut mid-record), which were never read.

Output rows (JSONL, input order, written atomically: a temporary file renamed when complete)::

    {"id": str, "source_index": int, "messages": [{"role", "content"}, ...],
     "truncated": bool, "truncated_turns": [message indices of answers cut by max_new_tokens]}

Choices (documented for users):
- ``max_turns`` caps the assistant turns regenerated per conversation (the rest of the
  conversation is dropped); the CPU demo uses 1.
- A conversation stops at the last assistant turn whose prompt fits in ``max_prompt_tokens``; if the
  first one does not fit, the row is skipped (reason recorded).
- A conversation also stops after an answer cut by ``max_new_tokens`` (later turns would be
  conditioned on an answer the target never finished); the cut answer is kept and flagged.
- Regenerated answers are stripped of surrounding whitespace: leading whitespace would make the
  chat-template render drift from the generation prompt (see :mod:`deepspec.data.chat`).
- Within one round of turns, conversations are sorted by prompt length inside windows of
  ``sort_window`` jobs to reduce padding; output order is unaffected.

Measured speed (embedded SmolLM2-135M, fp32, 2 CPU cores shared with other jobs, ShareGPT demo,
``max_turns=1``, ``max_prompt_tokens=256``, ``max_new_tokens=128``, prefill included): batch 16:
65 tok/s, batch 32: 78 tok/s; about 105 generated tokens per conversation (72 % hit the limit:
SmolLM2 answers at length). So ~150 conversations with ``max_new_tokens=96`` take ~3-4 minutes.
Batched output is token-identical to batch 16 vs 32 (left padding is exact in fp32).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.data.chat import end_of_turn_ids, render_prompt
from deepspec.data.conversations import SkipRow, load_sharegpt_demo, normalise_messages, read_jsonl
from deepspec.utils import atomic_path, atomic_write_json

SHAREGPT_DEMO = "sharegpt-demo"


def _render_errors() -> tuple[type[BaseException], ...]:
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - jinja2 is a dependency of chat templates
        return (ValueError,)
    return (ValueError, TemplateError)


_RENDER_ERRORS = _render_errors()


@dataclass(kw_only=True)
class PrepareConfig:
    """Settings of the prepare stage (see the module docstring for the rules)."""

    input: str  # "sharegpt-demo" or a JSONL path
    output: Path
    num_conversations: int = 200  # conversations to keep (the first usable ones, in input order)
    max_new_tokens: int = 128  # per regenerated answer; answers that hit it are flagged truncated
    batch_size: int = 32  # conversations generated together (left padding); 32 beat 16 on 2 CPU cores
    max_prompt_tokens: int = 512
    max_turns: int | None = 1  # assistant turns regenerated per conversation; None = all
    temperature: float = 0.0  # 0 = greedy
    skip_bad_rows: bool = True  # False: the first unusable row raises ValueError naming it
    seed: int = 0
    sort_window: int | None = None  # jobs sorted by prompt length per window; None = whole round
    target: str = "default"  # used when run_prepare is not given a model
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        positive = {"num_conversations": self.num_conversations, "max_new_tokens": self.max_new_tokens,
                    "batch_size": self.batch_size, "max_prompt_tokens": self.max_prompt_tokens}
        if self.max_turns is not None:
            positive["max_turns"] = self.max_turns
        if self.sort_window is not None:
            positive["sort_window"] = self.sort_window
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PrepareConfig.{name}={value!r}: expected a positive integer.")
        if not (self.temperature >= 0.0):
            raise ValueError(f"PrepareConfig.temperature={self.temperature!r}: expected >= 0 (0 = greedy).")
        if self.input != SHAREGPT_DEMO and not str(self.input).endswith((".jsonl", ".json")) \
                and not Path(self.input).is_file():
            raise ValueError(f"PrepareConfig.input={self.input!r}: expected {SHAREGPT_DEMO!r} or a JSONL file path.")


@dataclass(kw_only=True)
class PrepareSummary:
    read: int  # rows examined (= kept + skipped + failed)
    kept: int
    skipped: int
    failed: int
    truncated: int  # kept rows with at least one answer cut by max_new_tokens
    lost_in_source: int  # records the source file itself lost (not read)
    num_regenerated_turns: int = 0
    num_generated_tokens: int = 0
    generate_s: float = 0.0
    output: str = ""
    skipped_path: str = ""

    @property
    def tok_per_s(self) -> float:
        return self.num_generated_tokens / self.generate_s if self.generate_s > 0 else 0.0


def skipped_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.skipped.jsonl`` (the list of skipped/failed rows with reasons)."""
    output = Path(output)
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(stem + ".skipped.jsonl")


@dataclass
class _Conversation:
    index: int  # position among kept rows
    source_index: int
    row_id: str
    source: list[dict[str, str]]  # normalised, cut to max_turns assistant turns
    assistant_positions: list[int]
    history: list[dict[str, str]] = field(default_factory=list)  # regenerated so far (ends after an answer)
    next_turn: int = 0  # index into assistant_positions
    done: bool = False
    truncated_turns: list[int] = field(default_factory=list)


def _cut_to_turns(messages: list[dict[str, str]], max_turns: int | None) -> list[dict[str, str]]:
    """Keep messages up to the ``max_turns``-th assistant turn (all when None); drop a trailing user tail."""
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if max_turns is not None:
        positions = positions[:max_turns]
    return messages[: positions[-1] + 1]


def _iter_source(cfg: PrepareConfig) -> tuple[Iterable[dict[str, Any]], int]:
    if cfg.input == SHAREGPT_DEMO:
        src = load_sharegpt_demo(None)
        return src.rows, src.num_lost
    return read_jsonl(cfg.input), 0


def _select(cfg: PrepareConfig, tokenizer: Any, rows: Iterable[dict[str, Any]], skipped: list[dict[str, Any]]
            ) -> tuple[list[_Conversation], int]:
    """First ``num_conversations`` usable rows. Returns (conversations, rows_read)."""
    convs: list[_Conversation] = []
    read = 0
    for source_index, row in enumerate(rows):
        if len(convs) >= cfg.num_conversations:
            break
        read += 1
        row_id = str(row.get("id", f"{Path(str(cfg.input)).stem}-{source_index}")) if isinstance(row, dict) \
            else f"row-{source_index}"
        where = f"{cfg.input}[{source_index}] (id {row_id})"
        try:
            messages = _cut_to_turns(normalise_messages(row, where=where), cfg.max_turns)
            positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            prompt_len = len(render_prompt(tokenizer, messages[: positions[0]]))
            if prompt_len > cfg.max_prompt_tokens:
                raise SkipRow(f"first prompt has {prompt_len} tokens > max_prompt_tokens={cfg.max_prompt_tokens}",
                              where=where)
        except SkipRow as exc:
            if not cfg.skip_bad_rows:
                raise ValueError(f"{exc} (set skip_bad_rows=True to skip and count such rows)") from None
            skipped.append({"source_index": source_index, "id": row_id, "status": "skipped", "reason": exc.reason})
            continue
        except _RENDER_ERRORS as exc:  # the chat template refused the conversation
            if not cfg.skip_bad_rows:
                raise ValueError(f"{where}: chat template failed: {exc}") from exc
            skipped.append({"source_index": source_index, "id": row_id, "status": "failed",
                            "reason": f"chat template failed: {exc}"})
            continue
        convs.append(_Conversation(index=len(convs), source_index=source_index, row_id=row_id,
                                   source=messages, assistant_positions=positions))
    return convs, read


def _left_pad(batch_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns (input_ids_BT long, attention_mask_BT long)."""
    width = max(len(ids) for ids in batch_ids)
    input_ids_BT = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(batch_ids), width), dtype=torch.long)
    for b, ids in enumerate(batch_ids):
        input_ids_BT[b, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask_BT[b, width - len(ids):] = 1
    return input_ids_BT, attention_mask_BT


def generate_batch(model: Any, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                   temperature: float) -> list[tuple[list[int], bool]]:
    """Generate one answer per prompt (left padded, one ``model.generate`` call).

    Returns per prompt ``(answer_ids without the end-of-turn token, truncated)``, where ``truncated``
    means no end-of-turn token appeared within ``max_new_tokens``.
    """
    from transformers import GenerationConfig

    input_ids_BT, attention_mask_BT = _left_pad(prompts, pad_id)
    device = next(model.parameters()).device
    sampling = temperature > 0
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampling, temperature=temperature if sampling else None,
        top_k=0 if sampling else None, top_p=1.0 if sampling else None,
        pad_token_id=pad_id, eos_token_id=eos_ids,
    )
    with torch.inference_mode():
        out_BT = model.generate(input_ids=input_ids_BT.to(device), attention_mask=attention_mask_BT.to(device),
                                generation_config=gen_cfg)
    new_BN = out_BT[:, input_ids_BT.shape[1]:].cpu().tolist()
    eos = set(eos_ids)
    results = []
    for row in new_BN:
        cut = next((k for k, t in enumerate(row) if t in eos), None)
        results.append((row, True) if cut is None else (row[:cut], False))
    return results


def _windows(jobs: list[Any], size: int | None) -> Iterator[list[Any]]:
    if size is None:
        yield jobs
        return
    for start in range(0, len(jobs), size):
        yield jobs[start:start + size]


def run_prepare(cfg: PrepareConfig, model: Any = None, tokenizer: Any = None, *,
                log: Callable[[str], None] = print) -> PrepareSummary:
    """Run the prepare stage; write ``cfg.output`` (+ ``.skipped.jsonl`` + ``.summary.json``) atomically.

    Args:
        cfg: the stage settings.
        model, tokenizer: the target; loaded from ``cfg.target`` when omitted.
        log: where progress lines go.

    Returns:
        The counts (``read == kept + skipped + failed``) and generation speed.

    Raises:
        ValueError: a malformed JSONL line (``file:line``), or an unusable row with ``skip_bad_rows=False``.
        Exceptions from generation propagate; nothing is then written under the final output names.
    """
    from tqdm.auto import tqdm

    if model is None or tokenizer is None:
        from deepspec.target.load import load_target

        model, tokenizer = load_target(cfg.target)
    torch.manual_seed(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = sorted(end_of_turn_ids(tokenizer))

    skipped: list[dict[str, Any]] = []
    rows, lost_in_source = _iter_source(cfg)
    convs, read = _select(cfg, tokenizer, rows, skipped)
    del rows
    failed = sum(1 for s in skipped if s["status"] == "failed")
    total_turns = sum(len(c.assistant_positions) for c in convs)
    num_tokens = 0
    num_turns = 0
    generate_s = 0.0
    bar = tqdm(total=total_turns, desc="regenerate turns", unit="turn", disable=not cfg.show_progress)
    while True:
        # One round = the next assistant turn of every unfinished conversation.
        jobs: list[tuple[_Conversation, list[int]]] = []
        for conv in convs:
            if conv.done:
                continue
            pos = conv.assistant_positions[conv.next_turn]
            start = conv.assistant_positions[conv.next_turn - 1] + 1 if conv.next_turn else 0
            context = conv.history + conv.source[start:pos]
            try:
                prompt = render_prompt(tokenizer, context)
            except _RENDER_ERRORS as exc:
                conv.done, conv.history = True, []
                skipped.append({"source_index": conv.source_index, "id": conv.row_id, "status": "failed",
                                "reason": f"render failed at assistant turn {conv.next_turn}: {exc}"})
                failed += 1
                bar.update(len(conv.assistant_positions) - conv.next_turn)
                continue
            if len(prompt) > cfg.max_prompt_tokens:
                conv.done = True  # stop at the last turn that fits (the first one fits: checked in _select)
                bar.update(len(conv.assistant_positions) - conv.next_turn)
                continue
            jobs.append((conv, prompt))
        if not jobs:
            break
        for window in _windows(jobs, cfg.sort_window):
            window = sorted(window, key=lambda job: len(job[1]))
            for b in range(0, len(window), cfg.batch_size):
                batch = window[b:b + cfg.batch_size]
                t0 = time.perf_counter()
                answers = generate_batch(model, [p for _, p in batch], pad_id=pad_id, eos_ids=eos_ids,
                                         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
                generate_s += time.perf_counter() - t0
                for (conv, _), (ids, cut) in zip(batch, answers):
                    num_tokens += len(ids) + (0 if cut else 1)
                    num_turns += 1
                    pos = conv.assistant_positions[conv.next_turn]
                    start = conv.assistant_positions[conv.next_turn - 1] + 1 if conv.next_turn else 0
                    conv.history = conv.history + conv.source[start:pos] + [
                        {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True).strip()}
                    ]
                    conv.next_turn += 1
                    if cut:
                        conv.truncated_turns.append(len(conv.history) - 1)
                    finished = cut or conv.next_turn >= len(conv.assistant_positions)
                    bar.update(1 + (len(conv.assistant_positions) - conv.next_turn if finished else 0))
                    conv.done = finished
                bar.set_postfix(tok_per_s=f"{num_tokens / max(generate_s, 1e-9):.0f}")
    bar.close()

    out_rows = [c for c in convs if c.history]
    summary = PrepareSummary(
        read=read, kept=len(out_rows), skipped=sum(1 for s in skipped if s["status"] == "skipped"), failed=failed,
        truncated=sum(1 for c in out_rows if c.truncated_turns), lost_in_source=lost_in_source,
        num_regenerated_turns=num_turns, num_generated_tokens=num_tokens, generate_s=round(generate_s, 3),
        output=str(cfg.output), skipped_path=str(skipped_path_for(cfg.output)),
    )
    assert summary.read == summary.kept + summary.skipped + summary.failed, summary

    skipped.sort(key=lambda s: s["source_index"])
    with atomic_path(skipped_path_for(cfg.output)) as tmp:
        tmp.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped), encoding="utf-8")
    with atomic_path(cfg.output) as tmp:
        with tmp.open("w", encoding="utf-8") as f:
            for c in out_rows:  # kept rows are already in input order
                f.write(json.dumps({"id": c.row_id, "source_index": c.source_index, "messages": c.history,
                                    "truncated": bool(c.truncated_turns), "truncated_turns": c.truncated_turns},
                                   ensure_ascii=False) + "\n")
    cfg_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    atomic_write_json(cfg.output.with_name(cfg.output.name + ".summary.json"),
                      {"config": cfg_dict, "summary": asdict(summary), "tok_per_s": round(summary.tok_per_s, 1)})
    log(f"prepare: read {summary.read} = kept {summary.kept} + skipped {summary.skipped} + failed {summary.failed}; "
        f"truncated {summary.truncated}; lost in source {summary.lost_in_source}; "
        f"{num_turns} turns, {num_tokens} tokens in {generate_s:.1f} s ({summary.tok_per_s:.1f} tok/s) -> {cfg.output}")
    return summary
