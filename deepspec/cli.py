"""The ``deepspec`` command: one entry point, one subcommand per stage.

    deepspec prepare  regenerate chat answers with the target          -> prepared JSONL
    deepspec cache    capture target features into a target cache       -> cache folder
    deepspec train    train a DSpark (or DFlash) draft on a target cache -> checkpoints
    deepspec eval     speculative decoding on benchmarks                -> report (MD, JSON, PNG)
    deepspec demo     all of the above on the embedded default target
    deepspec estimate target cache size per storage mode               -> a table
    deepspec serve    the target behind an OpenAI-compatible HTTP API  -> a local server

Each subcommand's flags are exactly the fields of its config dataclass (see ``deepspec.config``).
"""

from __future__ import annotations

import argparse
import sys

from deepspec.config import add_dataclass_arguments, dataclass_from_args


def _stages():
    # Imported lazily so `deepspec --help` is instant (torch/transformers take seconds to import).
    from deepspec.data.estimate import EstimateConfig
    from deepspec.data.openai_server import ServeConfig
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig
    from deepspec.stages import CacheConfig, EvalConfig
    from deepspec.train.loop import TrainConfig

    return {
        "prepare": (PrepareConfig, "regenerate assistant turns with the target"),
        "cache": (CacheConfig, "write the target cache (features + final hidden states)"),
        "train": (TrainConfig, "train a draft model on a target cache or online (features computed by the target)"),
        "eval": (EvalConfig, "evaluate drafts with speculative decoding on benchmarks"),
        "demo": (DemoConfig, "the whole pipeline on the embedded default target"),
        "estimate": (EstimateConfig, "target cache size per storage mode for a target config and dataset size"),
        "serve": (ServeConfig, "serve the target over an OpenAI-compatible HTTP API (tests, CPU use)"),
    }


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deepspec", description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser.stage_parsers = {}
    for name, (cls, help_text) in _stages().items():
        stage = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        add_dataclass_arguments(stage, cls)
        parser.stage_parsers[name] = stage
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cls = _stages()[args.command][0]
    try:
        cfg = dataclass_from_args(cls, args)
    except ValueError as exc:
        print(f"deepspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    from deepspec import stages
    from deepspec.data.backends import BackendError

    runner = {
        "prepare": stages.run_prepare_stage,
        "cache": stages.run_cache_stage,
        "train": stages.run_train_stage,
        "eval": stages.run_eval_stage,
        "demo": stages.run_demo_stage,
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
