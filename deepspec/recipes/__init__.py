"""Recipes: named, versioned settings for the stages, as data (``deepspec STAGE --recipe NAME``).

A recipe is a TOML file. Each table is named after a stage (``prepare``, ``cache``, ``train``,
``eval``, ``demo``, ...) and holds that stage's settings: the fields of its config dataclass, exactly
as its ``--help`` flags name them (``-`` written as ``_``). A ``[common]`` table holds settings shared
by every stage that has them (such as ``target``). Two top-level keys are allowed besides tables:
``description`` (one paragraph, printed by ``deepspec STAGE --recipe NAME --help``) and ``base``
(another recipe whose tables this one extends; its keys override the base's, table by table).
``"none"`` stands for None, since TOML has no null.

On the command line a recipe's settings replace the stage's defaults, and flags given on the same
command line still win: ``deepspec train --recipe qwen3-4b --cache-dir C --output-dir O --lr 3e-4``.

Named recipes live beside this module (``deepspec/recipes/*.toml``); a path to a ``.toml`` file works too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspec.config import dataclass_values

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (a declared dependency there)
    import tomli as tomllib

RECIPES_DIR = Path(__file__).resolve().parent
COMMON = "common"  # the table whose settings apply to every stage that has them


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: its tables merged over its base chain's (``sections``: table -> settings)."""

    name: str
    path: Path
    description: str
    sections: dict[str, dict[str, Any]]

    def settings(self, stage: str, config_class: type) -> dict[str, Any]:
        """The settings this recipe gives ``stage``, typed as ``config_class``'s fields: the
        ``[common]`` keys that are fields of ``config_class``, then the stage's own table over them.

        Raises:
            ValueError: the recipe has nothing for this stage; or a key of the stage's table is not
                a field of ``config_class``, or a value has the wrong type (the message names the
                recipe, table and key).
        """
        own = self.sections.get(stage)
        if own is None:
            tables = ", ".join(sorted(self.sections)) or "none"
            raise ValueError(f"recipe {self.name} ({self.path}): has no [{stage}] table (its tables: {tables}); "
                             f"drop --recipe or use a recipe made for `deepspec {stage}`")
        fields = set(config_class.__dataclass_fields__)
        common = {k: v for k, v in self.sections.get(COMMON, {}).items() if k in fields}
        values = dataclass_values(config_class, common, f"recipe {self.name} [{COMMON}]")
        values.update(dataclass_values(config_class, own, f"recipe {self.name} [{stage}]"))
        return values


def recipe_names() -> list[str]:
    """The named recipes shipped with DeepSpec (``deepspec/recipes/*.toml``), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def _recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"recipe: no file {path}")
        return path
    named = RECIPES_DIR / f"{name_or_path}.toml"
    if not named.is_file():
        raise ValueError(f"recipe: {name_or_path!r} is neither a named recipe ({', '.join(recipe_names())}) "
                         "nor a .toml file")
    return named


def load_recipe(name_or_path: str, *, _seen: tuple[Path, ...] = ()) -> Recipe:
    """Read a recipe by name (``deepspec/recipes/NAME.toml``) or from a ``.toml`` file, with its
    ``base`` chain merged (the base's tables first, this file's keys over them).

    Tables are not checked against any stage here (:meth:`Recipe.settings` checks a stage's keys).

    Raises:
        ValueError: an unknown name, invalid TOML (with its line), a top-level key other than
            ``description``, ``base`` and tables, or a ``base`` chain that loops.
        FileNotFoundError: a ``.toml`` path that does not exist.
    """
    path = _recipe_path(name_or_path)
    if path.resolve() in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path.resolve()))
        raise ValueError(f"recipe {path.stem}: its base chain loops ({chain})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"recipe {path}: not valid TOML ({exc})") from None
    name = path.stem
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    unknown = sorted(set(scalars) - {"description", "base"})
    if unknown:
        raise ValueError(f"recipe {name} ({path}): top-level keys {unknown} are not allowed; put settings in a "
                         "stage's table ([train], [eval], ...) or in [common]")
    sections: dict[str, dict[str, Any]] = {}
    if "base" in scalars:
        base_name = str(scalars["base"])
        if base_name.endswith(".toml") and not Path(base_name).is_absolute():
            base_name = str(path.parent / base_name)  # a file base is relative to this file
        base = load_recipe(base_name, _seen=(*_seen, path.resolve()))
        sections = {table: dict(values) for table, values in base.sections.items()}
    for table, values in data.items():
        if isinstance(values, dict):
            sections.setdefault(table, {}).update(values)
    return Recipe(name=name, path=path, description=str(scalars.get("description", "")).strip(), sections=sections)
