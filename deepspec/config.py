"""Typed configs on the command line.

Every stage is configured by a keyword-only dataclass. The CLI exposes exactly the dataclass's
fields as ``--field-name`` flags (argparse rejects unknown flags), converts each value to the
field's type, and builds the dataclass, whose ``__post_init__`` validates it. So a typo is an error,
never a silently ignored key.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _or_none(convert):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its errors
    return parse


def _converter(annotation: Any):
    """Return (converter, nargs) for a field annotation such as ``int``, ``str | None``, ``list[int]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        convert, nargs = _converter(args[0]) if len(args) == 1 else (str, None)
        if type(None) in typing.get_args(annotation) and nargs != "+":
            return _or_none(convert), nargs  # ``--field none`` restores the None default (e.g. "no limit")
        return convert, nargs
    if origin is list:
        (item,) = typing.get_args(annotation)
        return _converter(item)[0], "+"
    if annotation is bool:
        return _parse_bool, "?"  # a bare ``--flag`` means true; ``--flag false`` is accepted too
    if annotation in (int, float, str):
        return annotation, None
    if annotation is Path:
        return Path, None
    return str, None


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--field-name`` flag per field of the dataclass ``cls``.

    Fields without a default become required flags.
    """
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        convert, nargs = _converter(hints[field.name])
        has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = "required" if not has_default else f"default: {default}"
        extra = {"const": True} if nargs == "?" else {}
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=convert,
            nargs=nargs,
            **extra,
            required=not has_default,
            default=argparse.SUPPRESS,
            help=help_text,
        )


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace, **extra: Any) -> T:
    """Build ``cls`` from the flags given on the command line (others keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(namespace).items() if k in names}
    values.update(extra)
    return cls(**values)
