"""The registry: every drafting algorithm by name, one line each (:data:`ALGORITHMS`), and the
training-free baselines (:data:`BASELINES`); finding the algorithm of a saved draft and loading it; the
algorithms' training options (:func:`option_classes`, :func:`option_owners`) and export formats
(:func:`export_formats`).

An algorithm is one folder, ``deepspec/algorithms/<name>/`` (options, model, loss, proposer, export formats;
its ``__init__`` holds the :class:`~deepspec.algorithms.protocol.DraftAlgorithm` adapter), plus its line in
:data:`ALGORITHMS`. ``deepspec train --algorithm`` (its flags: the union of the options), ``deepspec eval``
(:func:`load_draft`), ``deepspec export --format``, the demo's ``--algorithms`` and ``bench/train.py`` read
this registry and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from deepspec.algorithms.dspark import DSparkAlgorithm
from deepspec.algorithms.dspark.original import is_original_layout, load_original_dspark
from deepspec.algorithms.eagle3 import Eagle3Algorithm
from deepspec.algorithms.protocol import DraftAlgorithm, DraftOptions
from deepspec.models.config import CONFIG_NAME
from deepspec.models.engine_layout import ExportFormat
from deepspec.target.load import target_fingerprint as fingerprint_of


# name -> a factory of the algorithm (DFlash is DSpark's configuration without heads)
ALGORITHMS: dict[str, Callable[[], DraftAlgorithm]] = {
    "dspark": lambda: DSparkAlgorithm("dspark", heads=True),
    "dflash": lambda: DSparkAlgorithm("dflash", heads=False),
    "eagle3": Eagle3Algorithm,
}
DEFAULT_ALGORITHM = "dspark"  # deepspec train --algorithm


# training-free proposers selectable with --baselines (deepspec.algorithms.ngram; built by
# deepspec.decoding.settings.build_proposers)
BASELINES = ("ngram", "ngram+corpus")


def get_algorithm(name: str) -> DraftAlgorithm:
    """The algorithm registered under ``name``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
    """
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {sorted(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]()


def option_classes() -> list[type[DraftOptions]]:
    """The registered algorithms' ``Options`` classes, each once, in registration order (DSpark and DFlash
    share one)."""
    return list(dict.fromkeys(get_algorithm(name).Options for name in ALGORITHMS))


def option_owners() -> dict[str, list[str]]:
    """Option field -> the registered algorithms whose ``Options`` have it (the shared
    :class:`~deepspec.algorithms.protocol.DraftOptions` fields: every algorithm)."""
    owners: dict[str, list[str]] = {}
    for name in ALGORITHMS:
        for field in dataclasses.fields(get_algorithm(name).Options):
            owners.setdefault(field.name, []).append(name)
    return owners


def export_formats() -> dict[str, dict[str, ExportFormat]]:
    """Format name -> {algorithm name -> the layout carrying its drafts}, over the registered algorithms'
    ``export_formats`` (``deepspec export --format``), formats in order of first declaration."""
    formats: dict[str, dict[str, ExportFormat]] = {}
    for name in ALGORITHMS:
        for fmt, layout in get_algorithm(name).export_formats.items():
            formats.setdefault(fmt, {})[name] = layout
    return formats


def algorithm_of_draft(path: str | Path) -> str:
    """The algorithm that saved the draft folder ``path`` (its ``config.json``'s ``deepspec_algorithm``).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: a ``config.json`` that no DeepSpec draft wrote (e.g. a target model folder), a draft
            config without ``deepspec_algorithm``, or an algorithm that is not registered.
    """
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME}; pass a draft folder written by `deepspec train`")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc.msg}); pass a draft folder written by `deepspec train`")
    if not isinstance(cfg, dict) or not ("deepspec_algorithm" in cfg or "draft_config" in cfg):
        raise ValueError(f"{path}: {CONFIG_NAME} is not a DeepSpec draft's (no 'deepspec_algorithm'); pass a "
                         f"checkpoint folder written by `deepspec train` (checkpoint-N/ or its draft/)")
    if "deepspec_algorithm" not in cfg:
        raise ValueError(f"{config_path}: no 'deepspec_algorithm' field (the algorithm that saved the draft); add "
                         "\"deepspec_algorithm\": \"dspark\" to it (\"dflash\" when its draft_config has "
                         "use_markov_head and use_confidence_head false) or re-save the draft with this DeepSpec "
                         "(`deepspec train`)")
    name = str(cfg["deepspec_algorithm"])
    if name not in ALGORITHMS:
        raise ValueError(f"{path}: saved by algorithm {name!r}, which is not registered ({sorted(ALGORITHMS)})")
    return name


def load_draft(path: str | Path, *, target_model: nn.Module | None = None, target_fingerprint: str | None = None,
               allow_target_mismatch: bool = False) -> tuple[str, nn.Module]:
    """``(algorithm name, model)`` of a saved draft folder: DeepSpec's own, or the original DeepSpec
    layout (``Qwen3DSparkModel``, :mod:`deepspec.algorithms.dspark.original`), loaded as a DSpark / DFlash draft.

    With ``target_model`` the draft is checked against it (:func:`check_draft_target`: another target
    shape is refused; another fingerprint is refused unless ``allow_target_mismatch``);
    ``target_fingerprint`` spares recomputing the target's. An original checkpoint that omits
    ``embed_tokens`` / ``lm_head`` needs ``target_model``.

    Raises:
        ValueError: an unreadable draft, or one made for another target (see :func:`check_draft_target`).
    """
    if is_original_layout(path):
        model = load_original_dspark(path, target_model=target_model)
        name = algorithm_for_model(model).name
    else:
        name = algorithm_of_draft(path)
        model = get_algorithm(name).load(path)
    if target_model is not None:
        check_draft_target(str(path), model.config, target_model, target_fingerprint=target_fingerprint,
                           allow_mismatch=allow_target_mismatch)
    return name, model


def check_draft_target(name: str, config: Any, target_model: nn.Module, *, target_fingerprint: str | None = None,
                       allow_mismatch: bool = False) -> dict[str, Any]:
    """Check that a draft was made for ``target_model`` (DSpark/DFlash/Eagle3 configs alike).

    Rule: the target's shape recorded in the draft's config (``family``, ``target_num_hidden_layers``,
    ``target_hidden_size``, ``vocab_size``) must equal the target's (``model_type``,
    ``num_hidden_layers``, ``hidden_size``, ``vocab_size``): a draft reads features of specific layers
    of a specific width and shares the target's vocabulary, so another shape is always an error. A
    recorded ``target_fingerprint`` that differs from the target's (same shape, other weights: a
    fine-tuned target, another dtype) is refused too unless ``allow_mismatch`` (``deepspec eval
    --allow-target-mismatch``), when it is accepted and reported. A draft that records no fingerprint
    (saved before DeepSpec recorded it, or by the original DeepSpec) cannot be checked beyond its shape.

    Args:
        name: the draft's name in messages.
        target_fingerprint: the target's :func:`deepspec.target.load.target_fingerprint` (computed when None).

    Returns:
        The record for the eval report: ``{"status": "match" | "mismatch_allowed" | "not_recorded",
        "draft_target_fingerprint", "target_fingerprint", "message"}`` (``message`` is empty on a match,
        else the warning to print).

    Raises:
        ValueError: a shape mismatch (naming every differing field, the draft's value and the
            target's), or a fingerprint mismatch without ``allow_mismatch`` (naming both fingerprints
            and the flag).
    """
    tc = target_model.config
    pairs = (("family", "model_type", getattr(config, "family", None), getattr(tc, "model_type", None)),
             ("target_num_hidden_layers", "num_hidden_layers", config.target_num_hidden_layers, tc.num_hidden_layers),
             ("target_hidden_size", "hidden_size", config.target_hidden_size, tc.hidden_size),
             ("vocab_size", "vocab_size", config.vocab_size, tc.vocab_size))
    wrong = [f"{draft_key}={have!r} (target {target_key}={want!r})" for draft_key, target_key, have, want in pairs
             if have != want]
    if wrong:
        raise ValueError(f"draft {name} was made for another target: {', '.join(wrong)}. Evaluate it against the "
                         f"target it was trained for (--target), or train a draft for this target.")
    fingerprint = target_fingerprint or fingerprint_of(target_model)
    recorded = getattr(config, "target_fingerprint", None)
    record = {"draft_target_fingerprint": recorded, "target_fingerprint": fingerprint}
    if recorded is None:
        return {"status": "not_recorded", **record, "message": (
            f"warning: draft {name} records no target fingerprint (saved before DeepSpec recorded it, or by the "
            f"original DeepSpec); only its shape was checked against this target")}
    if recorded == fingerprint:
        return {"status": "match", **record, "message": ""}
    what = (f"draft {name} was trained against target fingerprint {recorded[:16]}..., this target is "
            f"{fingerprint[:16]}... (same shape, other weights or dtype: a fine-tuned or converted target?)")
    if not allow_mismatch:
        raise ValueError(f"{what}. Its acceptance figures would describe another target. Pass "
                         f"--allow-target-mismatch true (allow_target_mismatch) to evaluate it anyway; the report "
                         f"then records the mismatch.")
    return {"status": "mismatch_allowed", **record,
            "message": f"WARNING: {what}; evaluating anyway (--allow-target-mismatch), recorded in the report"}


def algorithm_for_model(model: nn.Module) -> DraftAlgorithm:
    """The registered algorithm whose drafts look like ``model``.

    Raises:
        ValueError: no registered algorithm owns this model class.
    """
    for make in ALGORITHMS.values():
        algo = make()
        if algo.owns(model):
            return algo
    raise ValueError(f"no registered drafting algorithm owns a {type(model).__name__}")


def check_baselines(names: Sequence[str], field: str) -> list[str]:
    """The baselines asked for, without repeats; ``["none"]`` (or an empty list) means none.

    Raises ValueError naming ``field`` for an unknown name or ``none`` mixed with a baseline.
    """
    names = list(dict.fromkeys(names))
    if names in ([], ["none"]):
        return []
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise ValueError(f"{field}: expected some of {', '.join(BASELINES)} or none, received {', '.join(map(repr, bad))}.")
    return names
