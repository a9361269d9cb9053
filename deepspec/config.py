"""Typed configs on the command line.

Every stage is configured by a keyword-only dataclass. The CLI exposes exactly the dataclass's
fields as ``--field-name`` flags (argparse rejects unknown flags), converts each value to the
field's type, and builds the dataclass, whose ``__post_init__`` validates it. So a typo is an error,
never a silently ignored key. Each flag's ``--help`` text is the field's comment in the dataclass
source (the trailing ``# ...`` of its line, else the comment lines directly above it), then its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import re
import textwrap
import tokenize
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


_SECTION = re.compile(r"--\s*(.+?)\s*--")  # a section header comment: ``# -- Optimiser --``


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the source of ``cls`` (and of its dataclass bases).

    A field's comment is the trailing ``# ...`` on its definition (all its physical lines), else the
    block of comment lines directly above it (no blank line between). Read with :mod:`tokenize`, so a
    ``#`` inside a string is not a comment. Returns ``{}`` when the source is not available.
    """
    return _source_notes(cls)[0]


def field_sections(cls: type) -> dict[str, str]:
    """Field name -> its section: the title of the last header comment ``# -- Title --`` above it in
    the class body (fields before any header have none). The CLI groups ``--help`` by section."""
    return _source_notes(cls)[1]


def _source_notes(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    comments: dict[str, str] = {}
    sections: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # subclasses override their bases' comments
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        klass_comments, klass_sections = _class_body_notes(source)
        comments.update(klass_comments)
        sections.update(klass_sections)
    return comments, sections


def _class_body_notes(source: str) -> tuple[dict[str, str], dict[str, str]]:
    out: dict[str, str] = {}
    sections: dict[str, str] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return out, sections
    body_col = None  # indentation of the class body's statements
    above: list[str] = []  # comment lines directly above the current statement
    line: list[tokenize.TokenInfo] = []  # tokens of the current logical line
    depth = 0  # INDENT depth: 1 = class body
    section = None  # the title of the last section header seen
    for tok in tokens:
        if tok.type == tokenize.INDENT:
            depth += 1
            continue
        if tok.type == tokenize.DEDENT:
            depth -= 1
            continue
        if tok.type == tokenize.COMMENT and not line:  # a comment on a line of its own
            if depth == 1 and (body_col is None or tok.start[1] == body_col):
                text = tok.string.lstrip("#").strip()
                header = _SECTION.fullmatch(text)
                if header:
                    section, above = header.group(1), []
                else:
                    above.append(text)
            continue
        if tok.type == tokenize.NL and not line:  # a blank line (or the end of a comment line)
            if tok.line.strip() == "":
                above = []
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            code = [t for t in line if t.type not in (tokenize.COMMENT, tokenize.NL)]
            if depth == 1 and code:
                body_col = code[0].start[1] if body_col is None else body_col
                is_field = (len(code) >= 2 and code[0].type == tokenize.NAME and code[1].string == ":"
                            and code[0].start[1] == body_col)
                if is_field:
                    trailing = [t.string.lstrip("#").strip() for t in line if t.type == tokenize.COMMENT]
                    text = " ".join(trailing) if trailing else " ".join(above)
                    if text:
                        out[code[0].string] = text
                    if section:
                        sections[code[0].string] = section
            line, above = [], []
            continue
        line.append(tok)
    return out, sections


def _show_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "(empty)"
    if isinstance(value, str) and value == "":
        return '""'
    return str(value)


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                            preset: dict[str, Any] | None = None, preset_name: str = "") -> None:
    """Add one ``--field-name`` flag per field of the dataclass ``cls``.

    Fields without a default become required flags. Each flag's help is the field's source comment
    (:func:`field_comments`) followed by its default (``none`` for None: the comment says what that means);
    flags are listed in argument groups by the field's section (:func:`field_sections`).
    ``preset`` (field -> value, already typed, e.g. a recipe's settings from :func:`dataclass_values`)
    replaces those fields' defaults; a flag given on the command line still wins. ``preset_name``
    (e.g. ``recipe cpu``) labels them in the help.
    """
    preset = preset or {}
    hints = typing.get_type_hints(cls)
    comments, sections = _source_notes(cls)
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        title = sections.get(field.name)
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups[title] if title is not None else parser
        convert, nargs = _converter(hints[field.name])
        if field.default is not dataclasses.MISSING:
            default_text = f"default: {_show_default(field.default)}"
        elif field.default_factory is not dataclasses.MISSING:
            default_text = f"default: {_show_default(field.default_factory())}"
        else:
            default_text = "required"
        if field.name in preset:
            default_text = f"{preset_name}: {_show_default(preset[field.name])}; {default_text}"
        has_default = default_text != "required" or field.name in preset
        comment = comments.get(field.name, "")
        help_text = (f"{comment} ({default_text})" if comment else default_text).replace("%", "%%")
        extra = {"const": True} if nargs == "?" else {}
        target.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=convert,
            nargs=nargs,
            **extra,
            required=not has_default,
            default=preset.get(field.name, argparse.SUPPRESS),
            help=help_text,
        )


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace, **extra: Any) -> T:
    """Build ``cls`` from the flags given on the command line (others keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(namespace).items() if k in names}
    values.update(extra)
    return cls(**values)


def _typed_value(annotation: Any, value: Any) -> Any:
    """``value`` (as TOML or JSON gives it) checked against a field annotation and converted
    (``str`` -> ``Path``, ``int`` -> ``float``, ``"none"`` -> None for an optional field).
    Raises ValueError saying what was expected."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if type(None) in typing.get_args(annotation) and (value is None or (isinstance(value, str)
                                                                            and value.lower() in ("none", "null"))):
            return None
        errors = []
        for arg in args:
            try:
                return _typed_value(arg, value)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(" or ".join(errors))
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return [_typed_value(item, v) for v in value]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if annotation in (str, Path):
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return annotation(value)
    return value


def dataclass_values(cls: type, mapping: dict[str, Any], where: str) -> dict[str, Any]:
    """``mapping`` (field name -> value, e.g. a recipe's TOML table) checked against the fields of the
    dataclass ``cls`` and converted to their types (:func:`_typed_value`); the result can be passed to
    ``cls(**...)`` or used as CLI defaults.

    Raises:
        ValueError: a key that is not a field (with the closest field names), or a value of the wrong
            type; the message starts with ``where.key`` (e.g. ``recipe cpu [train].lr``).
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in mapping.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{where}.{key}: not a setting of this stage{hint} (its settings are its --help flags, "
                             "with - written as _)")
        try:
            out[key] = _typed_value(hints[key], value)
        except ValueError as exc:
            raise ValueError(f"{where}.{key}: {exc}") from None
    return out
