"""The deepspec command: one entry point, one subcommand per stage.

  deepspec prepare   regenerate chat answers with the target          -> prepared JSONL
  deepspec cache     capture target features into a target cache      -> cache folder
  deepspec train     train a draft on a target cache, or online       -> checkpoints
  deepspec eval      speculative decoding on benchmarks               -> report (MD, JSON, PNG)
  deepspec export    a trained draft in a serving engine's layout     -> folder (vLLM, SGLang)
  deepspec demo      all of the above on the embedded default target
  deepspec estimate  target cache size per storage mode               -> a table
  deepspec serve     the target (+ --draft) over an OpenAI-compatible API -> a local server

Drafting algorithms (deepspec train --algorithm): dspark (DSpark, the default), dflash (DFlash:
DSpark's drafter without its heads), eagle3 (Eagle3).

Each subcommand's flags are exactly the fields of its config dataclass (deepspec.config);
`deepspec STAGE --help` lists them. `--recipe NAME` (or a .toml file) sets them from a recipe
(deepspec/recipes: demo, cpu, qwen3-4b, qwen3-8b, qwen3-14b); flags given beside it win.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from deepspec.config import add_dataclass_arguments, dataclass_from_args
from deepspec.recipes import COMMON, Recipe, load_recipe, recipe_names

# stage -> (module, config class, one-line help). A config's module imports torch and transformers
# (seconds), so only the stage being run (or whose --help is asked for) is imported: `deepspec --help`
# imports neither.
_STAGES = {
    "prepare": ("deepspec.data.prepare", "PrepareConfig", "regenerate assistant turns with the target"),
    "cache": ("deepspec.stages", "CacheConfig", "write the target cache (features + final hidden states)"),
    "train": ("deepspec.train.config", "train_config_class",
              "train a draft model on a target cache or online (features computed by the target)"),
    "eval": ("deepspec.eval.stage", "EvalConfig", "evaluate drafts with speculative decoding on benchmarks"),
    "export": ("deepspec.export", "ExportConfig", "write a trained draft in the layout vLLM or SGLang loads"),
    "demo": ("deepspec.demo", "DemoConfig", "the whole pipeline on the embedded default target"),
    "estimate": ("deepspec.data.estimate", "EstimateConfig",
                 "target cache size per storage mode for a target config and dataset size"),
    "serve": ("deepspec.serve.openai_server", "ServeConfig",
              "serve the target over an OpenAI-compatible HTTP API; speculative with --draft"),
}


def _config_class(stage: str) -> type:
    module, name, _ = _STAGES[stage]
    found = getattr(importlib.import_module(module), name)
    return found if isinstance(found, type) else found()  # a function: the class for the registry as it is now


class _Parser(argparse.ArgumentParser):
    """Reports a flag the chosen stage does not know with that stage's usage (plain argparse would
    print the top-level ``deepspec`` usage, which lists no stage flags)."""

    stage_parsers: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            stage = self.stage_parsers.get(getattr(parsed, "command", None) or "", self)
            stage.error(f"unrecognized arguments: {' '.join(extras)} (see `{stage.prog} --help`)")
        return parsed


def build_parser(stages: tuple[str, ...] | None = None, recipe: Recipe | None = None) -> argparse.ArgumentParser:
    """The ``deepspec`` parser: one subcommand per stage, whose flags are its config's fields.

    Args:
        stages: the stages whose flags are added (their config modules are imported); ``None`` = all.
            The others are listed with their one-line help only, so ``deepspec --help`` stays fast.
        recipe: its settings for each stage in ``stages`` become that stage's defaults
            (:meth:`Recipe.settings`; ValueError for a key or value the stage does not take).
    """
    parser = _Parser(
        prog="deepspec", description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser.stage_parsers = {}
    for name, (_, _, help_text) in _STAGES.items():
        description = help_text
        if recipe is not None and recipe.description and (stages is None or name in stages):
            description += "\n\n" + textwrap.fill(f"recipe {recipe.name}: {' '.join(recipe.description.split())}", 100)
        stage = sub.add_parser(name, help=help_text, description=description, allow_abbrev=False,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        if stages is None or name in stages:
            # listed for --help only: main() takes --recipe out of argv (it may stand anywhere) before parsing
            stage.add_argument("--recipe", metavar="NAME|FILE",
                               help=f"settings from a recipe: {', '.join(recipe_names())} (deepspec/recipes), or a "
                                    ".toml file; flags given beside it win")
            cls = _config_class(name)
            preset = recipe.settings(name, cls) if recipe is not None else None
            add_dataclass_arguments(stage, cls, preset=preset, preset_name=f"recipe {recipe.name}" if recipe else "")
        parser.stage_parsers[name] = stage
    return parser


def _split_recipe(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(the recipe named by --recipe NAME / --recipe=NAME, argv without it)``; the last one wins, and it
    may stand anywhere (before the stage too). ValueError when ``--recipe`` has no value."""
    name, rest = None, []
    args = iter(argv)
    for arg in args:
        if arg == "--recipe":
            name = next(args, None)
            if name is None or name.startswith("-"):
                raise ValueError("--recipe: expected a recipe name or a .toml file after it")
        elif arg.startswith("--recipe="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return name, rest


def _check_recipe(recipe: Recipe) -> None:
    """Every table of ``recipe`` names a stage (or is ``[common]``), and every ``[common]`` key is a setting of
    some stage: a typo there would otherwise be ignored. ValueError naming the table or key."""
    unknown = sorted(set(recipe.sections) - set(_STAGES) - {COMMON})
    if unknown:
        raise ValueError(f"recipe {recipe.name} ({recipe.path}): tables {unknown} are not stages; expected some "
                         f"of {', '.join(_STAGES)} or {COMMON}")
    common = recipe.sections.get(COMMON, {})
    if common:
        fields = {f for stage in _STAGES for f in _config_class(stage).__dataclass_fields__}
        stray = sorted(set(common) - fields)
        if stray:
            raise ValueError(f"recipe {recipe.name} [{COMMON}]: {stray} are not settings of any stage "
                             "(see `deepspec STAGE --help`)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = None
    try:
        recipe_name, argv = _split_recipe(argv)  # --recipe may stand anywhere; it is taken out before parsing
        # the stage is the first word that is no option (the top-level parser has no option taking a value)
        named = next((a for a in argv if not a.startswith("-")), None)
        recipe = None if recipe_name is None else load_recipe(recipe_name)
        if recipe is not None:
            _check_recipe(recipe)
        parser = build_parser(stages=(named,) if named in _STAGES else (), recipe=recipe)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deepspec {named or ''}: error: {exc}".replace("  ", " "), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    cls = _config_class(args.command)
    try:
        cfg = dataclass_from_args(cls, args)
    except ValueError as exc:
        print(f"deepspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    # lazy on purpose (see _STAGES): these import torch and transformers, which `deepspec --help` must not
    from deepspec import demo, export, stages
    from deepspec.eval import stage as eval_stage
    from deepspec.data.backends import BackendError

    runner = {
        "prepare": stages.run_prepare_stage,
        "cache": stages.run_verify_cache_stage if getattr(cfg, "verify", False) else stages.run_cache_stage,
        "train": stages.run_train_stage,
        "eval": eval_stage.run_eval_stage,
        "export": export.run_export,
        "demo": demo.run_demo,
        "estimate": stages.run_estimate_stage,
        "serve": stages.run_serve_stage,
    }[args.command]
    try:
        runner(cfg)
    except (ValueError, FileNotFoundError, BackendError) as exc:
        print(f"deepspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"deepspec {args.command}: interrupted. Finished outputs are kept and nothing half-written carries "
            "a final name; run the same command again to continue.",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
