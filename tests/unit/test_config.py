import argparse
from dataclasses import dataclass

import pytest

from deepspec.config import add_dataclass_arguments, dataclass_from_args


@dataclass(kw_only=True)
class _Cfg:
    path: str
    steps: int = 3
    lr: float = 1e-3
    flag: bool = False
    ids: list[int] | None = None
    name: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Cfg)
    return dataclass_from_args(_Cfg, parser.parse_args(argv))


def test_flags_convert_to_field_types_and_keep_defaults():
    cfg = _parse(["--path", "x", "--steps", "7", "--flag", "true", "--ids", "1", "9", "17"])
    assert cfg == _Cfg(path="x", steps=7, lr=1e-3, flag=True, ids=[1, 9, 17], name=None)


def test_unknown_flag_and_missing_required_flag_are_errors():
    with pytest.raises(SystemExit):
        _parse(["--path", "x", "--stepz", "7"])
    with pytest.raises(SystemExit):
        _parse(["--steps", "7"])


def test_validation_runs_at_construction():
    with pytest.raises(ValueError, match="steps"):
        _parse(["--path", "x", "--steps", "0"])


def test_cli_parser_builds_every_stage():
    from deepspec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--cache-dir", "c", "--output-dir", "o", "--max-steps", "5"])
    assert args.command == "train" and args.max_steps == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--cache-dir", "c", "--output-dir", "o", "--max-stepz", "5"])


def test_cli_refuses_abbreviated_flags_and_reports_bad_values_per_stage(capsys):
    from deepspec.cli import build_parser, main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--cache-dir", "c", "--output-dir", "o", "--max-step", "5"])
    assert main(["train", "--cache-dir", "c", "--output-dir", "o", "--max-steps", "0"]) == 2
    assert "deepspec train: error: train.max_steps" in capsys.readouterr().err


def test_bare_bool_flag_means_true_and_explicit_values_still_work():
    assert _parse(["--path", "x", "--flag"]).flag is True
    assert _parse(["--path", "x", "--flag", "false"]).flag is False
    assert _parse(["--path", "x"]).flag is False
    with pytest.raises(SystemExit):
        _parse(["--path", "x", "--flag", "maybe"])


def test_optional_fields_accept_none():
    assert _parse(["--path", "x", "--name", "none"]).name is None
    assert _parse(["--path", "x", "--name", "abc"]).name == "abc"
    with pytest.raises(SystemExit):
        _parse(["--path", "x", "--steps", "none"])  # not optional
