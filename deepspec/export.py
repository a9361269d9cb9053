"""``deepspec export``: a trained draft in the layout a serving engine loads.

Each algorithm declares the formats that carry its drafts (its ``export_formats``, format name ->
:class:`~deepspec.models.engine_layout.ExportFormat`; docs/export.md has each one's keys, weight names and
sources): DSpark and DFlash ``vllm-dspark``, ``vllm-dflash`` and ``speculators``
(:mod:`deepspec.algorithms.dspark.export`), Eagle3 ``vllm-eagle3``, ``sglang-eagle3`` and ``speculators``
(:mod:`deepspec.algorithms.eagle3.export`). ``--format`` takes any format a registered algorithm carries
(:func:`deepspec.algorithms.registry.export_formats`), and a draft whose algorithm does not carry it is
refused, naming the formats that do.

This module keeps the rules every format follows: weight names without a ``model.`` prefix; the target's
embedding is never shipped (every engine shares the target's); ``lm_head`` and ``d2t`` (int64 offsets,
``target id = i + d2t[i]``) are shipped only for a reduced draft vocabulary (N < V,
:func:`~deepspec.models.vocab.is_reduced_vocab`; a draft vocabulary of all V tokens exports as the full one);
every expected tensor is checked by name and shape before anything is written, because these loaders do not
report a missing weight (it would be served as uninitialised memory); a draft for a target with scaled
embeddings (Gemma) is refused, since no engine's draft layers compute it; the folder is written under a
temporary name and renamed when complete, and ``config.json`` records the draft's DeepSpec config and target
fingerprint under ``deepspec``. A format that names its target (``speculators``) gets it from ``--verifier``,
resolved here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepspec.algorithms.registry import export_formats, get_algorithm, load_draft
from deepspec.checkpoints import draft_folder
from deepspec.models.config import family_rules
from deepspec.models.engine_layout import ExportError, ExportFormat, flat_config
from deepspec.models.vocab import d2t_to_offsets, is_reduced_vocab
from deepspec.utils import atomic_path

WEIGHTS_NAME = "model.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class ExportConfig:
    """What to export, where, and in which engine's layout."""

    draft: str  # a training run (its latest checkpoint), a checkpoint folder or its draft/ folder
    format: str  # vllm-eagle3 | sglang-eagle3 | vllm-dspark | vllm-dflash (z-lab layout drafts) | speculators
    output_dir: str  # the export folder (config.json, model.safetensors)
    dtype: str = "bfloat16"  # weight dtype written: float32 | bfloat16 | float16 (engines cast to theirs)
    overwrite: bool = False  # replace an existing output_dir
    # speculators only: the target the draft serves with, written as speculators_config.verifier.name_or_path:
    # "default" (the embedded SmolLM2's converted folder), a model folder (checked against the draft) or a hub id
    verifier: str | None = None

    def __post_init__(self) -> None:
        if not str(self.output_dir).strip() or Path(self.output_dir).resolve() == Path.cwd().resolve():
            raise ValueError(f"export.output_dir: expected a folder of its own for the export, got "
                             f"{self.output_dir!r}; name a new folder such as exports/my-draft")
        formats = export_formats()
        if self.format not in formats:
            raise ValueError(f"export.format: expected one of {', '.join(formats)}, got {self.format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"export.dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        names_verifier = any(layout.names_verifier for layout in formats[self.format].values())
        if names_verifier and not self.verifier:
            raise ValueError(f"export.verifier: the {self.format} format names the target it serves with; pass "
                             "--verifier default (the embedded SmolLM2), a model folder or a hub id (org/name)")
        if not names_verifier and self.verifier:
            others = [name for name, by in formats.items() if any(layout.names_verifier for layout in by.values())]
            raise ValueError(f"export.verifier: only the {', '.join(others)} format names its target; {self.format} "
                             "takes the target on the engine's command line, so drop --verifier")


def _deepspec_record(algorithm: str, c: Any, source: Path) -> dict[str, Any]:
    return {"algorithm": algorithm, "source": str(source), "target_fingerprint": c.target_fingerprint,
            "target_layer_ids": list(c.target_layer_ids), "config": c.to_dict()}


def _verifier(name: str, c: Any) -> dict[str, Any]:
    """speculators_config.verifier for ``--verifier NAME``: ``default`` (the embedded target's converted
    folder), a GGUF target (its converted folder) or a local folder, which must hold a config.json of the
    draft's target shape; ``org/name`` is a hub id, written as given. A local path is written absolute,
    so the export serves on this machine (or where the same path holds the target)."""
    import re

    from deepspec.target.load import resolve_target_dir

    folder = Path(name).expanduser()
    if name == "default" or folder.is_file() or (folder.is_dir() and not (folder / "config.json").exists()
                                                 and any(folder.glob("*.gguf"))):
        folder = resolve_target_dir(name)  # the embedded default, or a GGUF target's converted folder
    elif not folder.exists():
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not name.startswith(("./", "../")):
            return {"name_or_path": name, "architectures": []}
        raise ExportError(f"export.verifier: {name!r} is neither an existing model folder nor a hub id (org/name); "
                          "name the target the draft was trained for")
    try:
        target = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"export.verifier: {folder} has no readable config.json ({exc}); name the target's model "
                          "folder, default (the embedded SmolLM2) or a hub id") from exc
    want = {"hidden_size": c.target_hidden_size, "num_hidden_layers": c.target_num_hidden_layers,
            "vocab_size": c.vocab_size}
    got = {k: target.get(k, target.get("text_config", {}).get(k)) for k in want}
    if got != want:
        raise ExportError(f"export.verifier: {folder} has {got}; the draft was made for a target with {want}. Name the "
                          "target the draft was trained for")
    return {"name_or_path": str(folder.resolve()), "architectures": list(target.get("architectures") or [])}


def _layout(fmt: str, algorithm: str | None) -> ExportFormat:
    """The layout of format ``fmt`` for drafts of ``algorithm`` (None: the one layout every carrier shares)."""
    carriers = export_formats().get(fmt, {})
    if algorithm is not None:
        if algorithm not in carriers:
            own = " or ".join(get_algorithm(algorithm).export_formats)
            raise ExportError(f"{fmt}: the draft is a {algorithm} draft; "
                              + (f"use --format {own}" if own else "no format carries its drafts")
                              + f" ({fmt} takes {' and '.join(carriers)} drafts)")
        return carriers[algorithm]
    layouts = list({id(layout): layout for layout in carriers.values()}.values())
    if len(layouts) != 1:
        raise ValueError(f"{fmt}: {' and '.join(carriers) or 'no algorithm'} drafts carry it in different layouts; "
                         "name the draft's algorithm")
    return layouts[0]


def _id_map_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``lm_head`` and ``d2t`` of a reduced draft vocabulary (:func:`~deepspec.models.vocab.is_reduced_vocab` of
    the exported ``vocab_size`` and ``draft_vocab_size``: the rule :func:`build_export` ships them by)."""
    flat = flat_config(config)
    V, N = flat.get("vocab_size"), flat.get("draft_vocab_size")
    return {"lm_head.weight": (N, flat["hidden_size"]), "d2t": (N,)} if is_reduced_vocab(V, N) else {}


def _full_size_draft_vocab(model: Any, fmt: str) -> None:
    """A draft vocabulary of all V target tokens exports as the full vocabulary (no ``lm_head``, no ``d2t``):
    its frozen ``lm_head`` is the target's rows ``d2t``, which is the target's own ``lm_head`` when ``d2t`` is the
    identity, as :func:`~deepspec.models.vocab.select_draft_vocab` chooses it (sorted ids).

    Raises:
        ExportError: ``d2t`` is another permutation of the target ids (the draft's outputs are in another order
            than the engine's, which would read them as the target's).
    """
    d2t = model.d2t.detach().cpu()
    if not torch.equal(d2t, torch.arange(d2t.shape[0], dtype=d2t.dtype)):
        raise ExportError(f"{fmt}: the draft vocabulary (d2t) holds all {d2t.shape[0]} target ids but not in target "
                          "id order; the engines load a draft vocabulary as large as the target's as the full "
                          "vocabulary, in target order. Train with a smaller --draft-vocab-size, or without one")


def expected_tensors(fmt: str, config: dict[str, Any], *, algorithm: str | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``fmt``'s loader needs, from the exported ``config`` alone (the
    format's own ``expected`` and the reduced vocabulary's id maps; docs/export.md). ``algorithm``: the
    draft's, when several algorithms carry ``fmt`` in different layouts (speculators). Used to check an export
    before it is written."""
    return {**_layout(fmt, algorithm).expected(config), **_id_map_tensors(config)}


def check_export(fmt: str, config: dict[str, Any], weights: dict[str, torch.Tensor], *,
                 algorithm: str | None = None) -> None:
    """Raise :class:`ExportError` unless ``weights`` holds exactly :func:`expected_tensors` (names and shapes)."""
    expected = expected_tensors(fmt, config, algorithm=algorithm)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if tuple(weights[k].shape) != expected[k])
    if missing or extra or wrong:
        details = "; ".join(part for part in (
            f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "",
            "wrong shapes " + ", ".join(f"{k} {tuple(weights[k].shape)} (expected {expected[k]})" for k in wrong)
            if wrong else "") if part)
        raise ExportError(f"{fmt}: the export does not match what the engine loads ({details}); nothing was written")


def build_export(draft_path: str | Path, fmt: str, *, dtype: torch.dtype = torch.bfloat16,
                 verifier: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """``(config.json dict, weights, serve hint)`` of the draft at ``draft_path`` in format ``fmt``.

    Weights are cast to ``dtype`` (``d2t`` stays int64, as offsets). ``verifier``: the target named in a
    ``speculators`` export (:class:`ExportConfig`; default: the embedded target). Nothing is written.

    Raises:
        ExportError: the draft cannot be expressed in ``fmt`` (the message names the limit).
        FileNotFoundError / ValueError: no readable draft at ``draft_path``.
    """
    folder = draft_folder(draft_path)
    algorithm, model = load_draft(folder)
    c = model.config
    if family_rules(c.family).embed_scale:
        raise ExportError(f"{fmt}: this draft is for a {c.family} target, whose RMSNorms are (1 + w) and whose token "
                          "embeddings are scaled by sqrt(hidden); the engines' draft layers (Qwen3 / Llama RMSNorm, "
                          "unscaled embeddings) would load it and compute another draft. Gemma drafts run in "
                          "DeepSpec's own engine (deepspec eval / serve --draft); no export format carries them yet")
    layout = _layout(fmt, algorithm)
    config, weights, hint = layout.write(
        model, algorithm=algorithm,
        verifier=(lambda: _verifier(verifier or "default", c)) if layout.names_verifier else None)
    if c.draft_vocab_size is not None:
        if is_reduced_vocab(c.vocab_size, c.draft_vocab_size):  # the id maps of a reduced vocabulary
            weights["lm_head.weight"] = model.state_dict()["lm_head.weight"]
            weights["d2t"] = d2t_to_offsets(model.d2t)
        else:  # all V target ids: the full vocabulary
            _full_size_draft_vocab(model, fmt)
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in weights.items()}
    check_export(fmt, config, weights, algorithm=algorithm)
    config["deepspec"] = _deepspec_record(algorithm, c, folder)
    return config, weights, hint


def _is_export(folder: Path) -> bool:
    """True for a folder this command wrote: exactly config.json (with its ``deepspec`` record) and the weights."""
    try:
        names = {p.name for p in folder.iterdir()}
        record = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("deepspec")
    except (OSError, ValueError, AttributeError):
        return False
    return names == {"config.json", WEIGHTS_NAME} and isinstance(record, dict)


def _check_output_dir(out: Path, cfg: ExportConfig) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"export.output_dir: {out} is a file; name a folder")
    if any(parent.exists() and not parent.is_dir() for parent in out.parents):
        raise ValueError(f"export.output_dir: a parent of {out} is a file; name a folder elsewhere")
    if out.exists():
        if not cfg.overwrite:
            raise ValueError(f"export.output_dir: {out} exists; pass --overwrite to replace an earlier export, or "
                             "choose another folder")
        if not _is_export(out):
            raise ValueError(f"export.output_dir: {out} exists and is not an earlier `deepspec export` (only "
                             "config.json with a deepspec record and model.safetensors); --overwrite replaces "
                             "only those, so choose another folder")


def _readable_by_all(folder: Path) -> None:
    """Exports are read by serving engines, often as another user: files 0644, the folder 0755, less the
    umask (safetensors writes its file readable by its owner only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o644 & ~umask)


def run_export(cfg: ExportConfig) -> Path:
    """Write the export folder (``config.json`` + ``model.safetensors``) atomically; return its path.

    Raises:
        ExportError: the format cannot express the draft (before anything is written).
        ValueError: ``output_dir`` is a file, or exists while ``overwrite`` is false;
            ``--overwrite`` replaces only an earlier export (config.json with a ``deepspec`` record and
            the weights, nothing else).
    """
    out = Path(cfg.output_dir)
    _check_output_dir(out, cfg)
    config, weights, hint = build_export(cfg.draft, cfg.format, dtype=_DTYPES[cfg.dtype], verifier=cfg.verifier)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _readable_by_all(tmp)
    print(f"export: {cfg.format} draft ({config['deepspec']['algorithm']}, {len(weights)} tensors, {cfg.dtype}) -> {out}")
    print("serve it with: " + hint.replace("DIR", str(out)))
    return out
