"""Building a fresh draft from a :class:`~deepspec.train.config.TrainConfig` (reduced draft vocabulary,
init from the target) and checking a checkpoint's draft against the settings of a resumed run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from deepspec.algorithms.registry import get_algorithm
from deepspec.models.vocab import count_supervised_tokens, select_draft_vocab
from deepspec.train.config import TrainConfig


def warn(message: str) -> None:
    """Print ``warning: message`` to stderr (training warnings the user should see but that do not stop a run)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def draft_vocab_from_data(data, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The reduced draft vocabulary of ``data`` (a :class:`TargetCache` or online data): ``d2t`` int64
    ``[draft_vocab_size]``, the target ids most frequent among the supervised tokens (``loss_mask`` 1),
    ties by id (:func:`deepspec.models.vocab.select_draft_vocab`). Reads only ``input_ids`` /
    ``loss_mask`` (online data runs no target forward for it).

    Raises:
        ValueError: ``draft_vocab_size`` larger than the target vocabulary (names ``train.draft_vocab_size``).
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"train.draft_vocab_size: expected at most the target vocabulary ({vocab_size}), got "
                         f"{draft_vocab_size}; pass a smaller N, or 0 for the full vocabulary")
    counts_V = count_supervised_tokens((data.read(i, ("input_ids", "loss_mask")) for i in range(len(data))),
                                       vocab_size)
    return select_draft_vocab(counts_V, draft_vocab_size)


def build_draft(target_model, tokenizer, cfg: TrainConfig, target_layer_ids: list[int], *,
                data=None, d2t: torch.Tensor | None = None) -> torch.nn.Module:
    """A freshly initialised draft of ``cfg.algorithm`` and the shape ``cfg`` asks for, seeded by ``cfg.seed``.

    With ``cfg.draft_vocab_size`` the draft vocabulary is ``d2t`` if given, else chosen from ``data``
    (:func:`draft_vocab_from_data`). The algorithm builds it from its own options (``cfg.options``; e.g.
    DSpark's ``init_from_target`` starts the draft's layers as copies of the target's,
    :mod:`deepspec.models.target_init`). The same call with the same seed gives the same untrained draft
    (used as the eval control).

    Raises:
        ValueError: ``cfg.draft_vocab_size`` without ``data`` or ``d2t``, or one the algorithm refuses.
    """
    if cfg.draft_vocab_size and d2t is None:
        if data is None:
            raise ValueError("train.draft_vocab_size: choosing a reduced draft vocabulary needs the training data; "
                             "pass data= (the target cache) or d2t= to build_draft")
        d2t = draft_vocab_from_data(data, cfg.draft_vocab_size, int(target_model.config.vocab_size))
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(cfg.seed)
        return get_algorithm(cfg.algorithm).build(target_model, tokenizer, cfg.options, target_layer_ids, d2t=d2t)


def _draft_settings(draft_config_json: dict[str, Any]) -> dict[str, Any]:
    """The settings a draft folder's ``config.json`` records, flattened: ``deepspec_algorithm`` and the
    fields of its nested ``*_config`` dict (``draft_config`` for DSpark/DFlash, ``eagle3_config``)."""
    flat = {k: v for k, v in draft_config_json.items() if k == "deepspec_algorithm"}
    for key, value in draft_config_json.items():
        if key.endswith("_config") and isinstance(value, dict):
            flat.update(value)
    return flat


def check_resume_shape(checkpoint: Path, model: torch.nn.Module, cfg: TrainConfig) -> None:
    """Refuse to resume ``checkpoint`` into a draft built with other settings (another layer set,
    ``--markov-head``, ``--markov-rank``, ``--num-draft-layers``, ``--block-size``, algorithm, ...):
    loading would fail with a raw size mismatch, or worse, succeed on a different model.

    Compares the checkpoint's ``draft/config.json`` with the fresh draft's config (``model.config.to_dict()``,
    what ``save_pretrained`` writes).

    Raises:
        ValueError: listing every differing field as ``{field: (checkpoint, now)}``, or naming a missing
            ``deepspec_algorithm``.
    """
    saved = _draft_settings(json.loads((checkpoint / "draft" / "config.json").read_text(encoding="utf-8")))
    if "deepspec_algorithm" not in saved:
        raise ValueError(f"train.resume: {checkpoint / 'draft' / 'config.json'} has no 'deepspec_algorithm' field; "
                         f"add \"deepspec_algorithm\": \"{cfg.algorithm}\" to it if that is the algorithm the "
                         "checkpoint was trained with, or start a new --output-dir")
    # JSON round trip: tuples become lists, as in the saved file
    now = {"deepspec_algorithm": cfg.algorithm, **json.loads(json.dumps(model.config.to_dict()))}
    if "target_fingerprint" not in saved:  # saved before DeepSpec recorded it (the cache check covers the target)
        now.pop("target_fingerprint", None)
    missing = object()
    # a field added after the checkpoint was written, at its "off" value (None), is no difference
    keys = sorted(saved.keys() | {k for k, v in now.items() if k in saved or v is not None})
    diff = {k: (saved.get(k, missing), now.get(k, missing)) for k in keys if saved.get(k, missing) != now.get(k, missing)}
    if diff:
        shown = ", ".join(f"{k}: ({'absent' if a is missing else repr(a)}, {'absent' if b is missing else repr(b)})"
                          for k, (a, b) in diff.items())
        raise ValueError(
            f"train.resume: checkpoint {checkpoint} was trained with {{{shown}}} (checkpoint, now); resume with the "
            "same settings or start a new --output-dir"
        )


def warn_ignored_flags(cfg: TrainConfig) -> list[str]:
    """Warn (stderr) about options set away from their defaults that ``cfg.algorithm`` does not read: its own
    its configuration ignores (``--markov-head`` / ``--markov-rank`` for dflash, which has no Markov head) and
    other algorithms' (``--block-size`` for eagle3, whose steps are ``--ttt-steps``; ``--ttt-steps`` for dspark),
    :meth:`~deepspec.train.config.TrainSettings.ignored_option_warnings`; returns the messages."""
    messages = cfg.ignored_option_warnings()
    for message in messages:
        warn(message)
    return messages
