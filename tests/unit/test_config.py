import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

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


def test_top_level_help_lists_every_algorithm_in_plain_text_without_importing_torch(capsys):
    import subprocess
    import sys

    from deepspec.algorithms.registry import ALGORITHMS
    from deepspec.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ALGORITHMS), out
    assert "``" not in out and ":func:" not in out and ":mod:" not in out
    # `deepspec --help` imports no stage module (torch and transformers take seconds to import)
    probe = ("import sys\nfrom deepspec.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.stderr.strip().splitlines()[-1] == "False False", run.stderr


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


@dataclass(kw_only=True)
class _Documented:
    """A docstring with a # that is not a comment."""

    # Where the data lives: a folder
    # or a file.
    path: str
    url: str = "http://x/#frag"  # base URL; the "#frag" in the string is not a comment
    limit: int | None = None  # None = no limit

    tags: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])  # labels (100% optional)
    plain: float = 0.5

    def method(self):
        inner: int = 3  # not a field
        return inner


def _help_of(parser, flag):
    for action in parser._actions:
        if flag in action.option_strings:
            return action.help
    raise KeyError(flag)


def test_help_text_is_the_field_comment_then_the_default():
    from deepspec.config import field_comments

    assert field_comments(_Documented) == {
        "path": "Where the data lives: a folder or a file.",
        "url": 'base URL; the "#frag" in the string is not a comment',
        "limit": "None = no limit",
        "tags": "labels (100% optional)",
    }
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Documented)
    assert _help_of(parser, "--path") == "Where the data lives: a folder or a file. (required)"
    assert _help_of(parser, "--url") == 'base URL; the "#frag" in the string is not a comment (default: http://x/#frag)'
    assert _help_of(parser, "--limit") == "None = no limit (default: none)"
    assert _help_of(parser, "--tags") == "labels (100%% optional) (default: a b)"
    assert _help_of(parser, "--plain") == "default: 0.5"
    assert "100% optional" in parser.format_help()


@dataclasses.dataclass(kw_only=True)
class _Sectioned:
    first: int = 0  # before any section
    # -- Data --
    # where the data lives
    path: str = "x"
    # -- Optimiser --
    lr: float = 1e-3  # peak learning rate


def test_section_headers_group_the_help():
    from deepspec.config import field_comments, field_sections

    assert field_sections(_Sectioned) == {"path": "Data", "lr": "Optimiser"}
    assert field_comments(_Sectioned)["path"] == "where the data lives"  # the header is not part of it
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Sectioned)
    text = parser.format_help()
    text = text[text.index("options:"):]  # past the usage line, which names every flag
    assert text.index("Data:") < text.index("--path") < text.index("Optimiser:") < text.index("--lr")
    assert text.index("--first") < text.index("Data:")


def test_train_help_is_grouped_by_section(capsys):
    from deepspec.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    out = out[out.index("options:"):]
    # the shared settings, then each algorithm's options in its own group (their Options classes' sections)
    order = ["Data and target:", "--cache-dir", "Draft:", "--algorithm", "--num-draft-layers", "Optimiser:", "--lr",
             "Checkpoints:", "--resume", "Learning curve:", "--heldout-every", "DSpark and DFlash:", "--block-size",
             "--ce-weight", "Eagle3:", "--ttt-steps", "--num-chains"]
    assert [out.index(s) for s in order] == sorted(out.index(s) for s in order)


def test_every_stage_flag_of_the_cli_has_a_description(capsys):
    from deepspec.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["cache", "--help"])
    out = capsys.readouterr().out
    assert "prepared rows per shard (default: 256)" in out
    assert "None: evenly spaced from 1 to L-3" in out and "(default: bfloat16)" in out
    stage = parser.stage_parsers["cache"]
    undocumented = [a.dest for a in stage._actions if a.help and a.help.startswith(("default:", "required"))]
    assert undocumented == []


def test_mistyped_stage_flag_reports_the_stage_usage(capsys):
    from deepspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["cache", "--output-dir", "o", "--input", "x", "--bogus", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: deepspec cache" in err and "--shard-size" in err
    assert "deepspec cache: error: unrecognized arguments: --bogus 1" in err
    with pytest.raises(SystemExit):  # abbreviations are still refused, with the stage usage
        main(["cache", "--output-dir", "o", "--input", "x", "--shard-siz", "3"])
    assert "deepspec cache: error: unrecognized arguments: --shard-siz 3" in capsys.readouterr().err


def test_demo_refuses_bad_training_settings_before_any_stage_runs(tmp_path):
    """A bad training setting of the demo fails at construction (not after minutes of prepare and
    cache), naming the demo's own flag."""
    from deepspec.demo import DemoConfig

    for kwargs, field in (({"draft_vocab_size": -3}, "demo.draft_vocab_size"), ({"lr": -1.0}, "demo.lr"),
                          ({"heldout_every": -1}, "demo.heldout_every"), ({"num_anchors": 0}, "demo.num_anchors"),
                          ({"eval_benchmarks": []}, "demo.eval_benchmarks"),
                          ({"eval_benchmarks": ["gsm8k", "gsm9k"]}, "demo.eval_benchmarks: unknown benchmark 'gsm9k'"),
                          ({"temperature": -1.0}, "demo.temperature"),
                          ({"eval_num_prompts_per_benchmark": ["alpaca=0"]}, "demo.eval_num_prompts_per_benchmark"),
                          ({"eval_num_prompts_per_benchmark": ["alpaca"]}, "demo.eval_num_prompts_per_benchmark"),
                          ({"eval_num_prompts_per_benchmark": ["alpacx=4"]},
                           "demo.eval_num_prompts_per_benchmark: 'alpacx' is not a benchmark")):
        with pytest.raises(ValueError, match=field):
            DemoConfig(output_dir=str(tmp_path / "demo"), **kwargs)
    assert not (tmp_path / "demo").exists()
    cfg = DemoConfig(output_dir=str(tmp_path / "demo"), algorithms=["dspark", "eagle3"])
    assert cfg.train_config("eagle3", tmp_path / "cache").output_dir == str(tmp_path / "demo" / "train-eagle3")
    with pytest.raises(ValueError, match="demo.lookup_first"):
        DemoConfig(output_dir=str(tmp_path / "demo"), lookup_first=0)
    # prompt lookup off: its token count (7 by default) is unused, not an error
    off = DemoConfig(output_dir=str(tmp_path / "demo"), lookup_first=None).eval_config(["d"], tmp_path / "eval")
    assert (off.lookup_first, off.lookup_num_tokens) == (None, None)
    # the lookups search the demo's regenerated answers; with nothing reading them, no corpus is passed
    on = DemoConfig(output_dir=str(tmp_path / "demo")).eval_config(["d"], tmp_path / "eval")
    assert on.lookup_corpus == [str(tmp_path / "demo" / "prepared.jsonl")] and "ngram+corpus" in on.baselines
    # per-benchmark prompt counts reach the eval (make recipe: fewer prompts on the general-chat sets)
    capped = DemoConfig(output_dir=str(tmp_path / "demo"), eval_num_prompts=8,
                        eval_num_prompts_per_benchmark=["alpaca=4"]).eval_config(["d"], tmp_path / "eval")
    assert capped.num_prompts == 8 and capped.caps() == {"alpaca": 4}
    bare = DemoConfig(output_dir=str(tmp_path / "demo"), lookup_first=None, baselines=["ngram"])
    assert bare.eval_config(["d"], tmp_path / "eval").lookup_corpus == []
    with pytest.raises(ValueError, match=r"demo.baselines: ngram\+corpus needs demo.lookup_corpus .*--lookup-corpus true"):
        DemoConfig(output_dir=str(tmp_path / "demo"), lookup_corpus=False)


def test_demo_refuses_a_training_folder_filled_with_other_settings(tmp_path):
    """A demo rerun into a folder whose draft an earlier demo trained with other settings (e.g. before a
    default changed) is refused, naming the settings; the same settings pass."""
    from deepspec.demo import DemoConfig, check_reused_training

    cfg = DemoConfig(output_dir=str(tmp_path / "demo"))
    train_cfg = cfg.train_config("dspark", tmp_path / "demo" / "cache")
    train_dir = Path(train_cfg.output_dir)
    check_reused_training(train_cfg, train_dir)  # nothing there yet
    train_dir.mkdir(parents=True)
    saved = dataclasses.asdict(train_cfg)
    (train_dir / "train_config.json").write_text(json.dumps(saved))
    check_reused_training(train_cfg, train_dir)
    (train_dir / "train_config.json").write_text(json.dumps({**saved, "num_anchors": 16, "output_dir": "elsewhere"}))
    with pytest.raises(ValueError, match=r"other settings .*'num_anchors': \(16, 64\).*delete"):
        check_reused_training(train_cfg, train_dir)


def test_demo_training_mix_is_the_same_rows_with_and_without_a_local_benchmarks_folder(tmp_path, monkeypatch):
    """The demo's and the recipe's training mix is exactly what they ask for (gsm8k + MBPP problems, no
    ShareGPT in its place), read from the files packaged with DeepSpec; a local benchmarks folder holding
    copies of the same upstream files resolves to the same rows (ids and messages), so the demo a user
    runs trains on what the demo run with such a folder trains on. No conversations at all, or a
    negative count, is refused at construction."""
    import gzip

    from deepspec.demo import DemoConfig, demo_data_plan, demo_training_records
    from deepspec.eval import benchmarks as B
    from deepspec.recipes import load_recipe

    monkeypatch.delenv(B.BENCHMARKS_DIR_ENV, raising=False)
    cfg = DemoConfig(output_dir=str(tmp_path / "demo"))
    assert demo_data_plan(cfg) == [("gsm8k", 192), ("mbpp", 128)]
    without = demo_training_records(cfg)
    assert {n: origin for n, (origin, _) in without.items()} == {
        n: B.PACKAGED_DIR / B.TRAINING_SPLITS[n].packaged for n in ("gsm8k", "mbpp")}

    bench = tmp_path / "bench"  # a user's folder: copies of the upstream files, as they are published
    for name in ("gsm8k", "mbpp"):
        split = B.TRAINING_SPLITS[name]
        (bench / split.local).parent.mkdir(parents=True, exist_ok=True)
        (bench / split.local).write_bytes(gzip.decompress((B.PACKAGED_DIR / split.packaged).read_bytes()))
    monkeypatch.setenv(B.BENCHMARKS_DIR_ENV, str(bench))
    assert demo_data_plan(cfg) == [("gsm8k", 192), ("mbpp", 128)]
    with_folder = demo_training_records(cfg)
    assert {n: origin for n, (origin, _) in with_folder.items()} == {
        n: bench / B.TRAINING_SPLITS[n].local for n in ("gsm8k", "mbpp")}
    for name in ("gsm8k", "mbpp"):  # prepare keeps the first usable conversations in this order
        assert with_folder[name][1] == without[name][1]
    assert without["gsm8k"][1][0]["id"] == "gsm8k-train-0"
    assert without["gsm8k"][1][0]["messages"][0]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert [c["id"] for c in without["mbpp"][1][:3]] == ["mbpp-train-0", "mbpp-train-1", "mbpp-train-2"]

    (bench / "gsm8k" / "train.jsonl").unlink()  # a folder without the file: the packaged copy, not ShareGPT
    (bench / "mbpp" / "mbpp_sanitized_for_code_generation.jsonl").unlink()
    assert demo_data_plan(cfg) == [("gsm8k", 192), ("mbpp", 128)]
    assert demo_training_records(cfg) == without

    recipe = load_recipe("cpu")  # `make recipe`: more in-domain problems than the demo, all of them there
    recipe_cfg = DemoConfig(**{**recipe.settings("demo", DemoConfig), "output_dir": str(tmp_path / "recipe")})
    plan = demo_data_plan(recipe_cfg)
    assert plan == [("gsm8k", 1536), ("mbpp", 170)]
    assert all(len(without[name][1]) >= count for name, count in plan)

    with pytest.raises(ValueError, match="demo.num_mbpp_conversations: expected an integer >= 0"):
        DemoConfig(output_dir=str(tmp_path / "demo"), num_mbpp_conversations=-1)
    with pytest.raises(ValueError, match="no training conversations"):
        DemoConfig(output_dir=str(tmp_path / "demo"), num_conversations=0, num_gsm8k_conversations=0,
                   num_mbpp_conversations=0)


def test_demo_data_parts_are_merged_once_and_reused(tmp_path, monkeypatch):
    """Each source is prepared into its own part (reused when present), and the parts are merged in a
    seeded shuffle with one summary whose render record the cache stage checks; a part of another
    size, or parts rendered differently, are refused."""
    from deepspec import demo
    from deepspec.data.prepare import summary_path_for

    bench = tmp_path / "bench"
    (bench / "gsm8k").mkdir(parents=True)
    (bench / "gsm8k" / "train.jsonl").write_text(
        "".join(json.dumps({"question": f"Q{i}", "answer": f"A{i}"}) + "\n" for i in range(5)))
    monkeypatch.setenv("DEEPSPEC_BENCHMARKS_DIR", str(bench))
    calls = []

    def fake_prepare(cfg, **kw):  # one prepared row per conversation asked, from the input it was given
        calls.append((cfg.input, cfg.num_conversations))
        rows = [{"id": f"{Path(cfg.input).stem}-{i}"} for i in range(cfg.num_conversations)]
        Path(cfg.output).write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary_path_for(Path(cfg.output)).write_text(json.dumps({"summary": {"kept": len(rows)}, "render": {"t": 1}}))

    monkeypatch.setattr(demo, "run_prepare_stage", fake_prepare)
    cfg = demo.DemoConfig(output_dir=str(tmp_path / "d"), num_conversations=2, num_gsm8k_conversations=3,
                          num_mbpp_conversations=0)
    prepared = tmp_path / "prepared.jsonl"
    demo.prepare_demo_data(cfg, prepared, target_model=None, tokenizer=None)
    assert calls == [("sharegpt-demo", 2), (str(tmp_path / "gsm8k-train-records.jsonl"), 3)]
    ids = [json.loads(line)["id"] for line in prepared.read_text().splitlines()]
    assert sorted(ids) == ["gsm8k-train-records-0", "gsm8k-train-records-1", "gsm8k-train-records-2",
                           "sharegpt-demo-0", "sharegpt-demo-1"]
    summary = json.loads(summary_path_for(prepared).read_text())
    assert summary["render"] == {"t": 1}
    assert summary["parts"]["gsm8k"] == {"conversations_asked": 3, "summary": {"kept": 3}}

    first = prepared.read_text()
    prepared.unlink()
    demo.prepare_demo_data(cfg, prepared, target_model=None, tokenizer=None)
    assert len(calls) == 2 and prepared.read_text() == first  # parts reused, same seeded order

    part = tmp_path / "prepared-gsm8k.jsonl"
    summary_path_for(part).write_text(json.dumps({"config": {"num_conversations": 4}, "summary": {}, "render": {"t": 1}}))
    with pytest.raises(ValueError, match="prepared-gsm8k.jsonl holds 4 gsm8k conversations, this demo asks for 3"):
        demo.prepare_demo_data(cfg, prepared, target_model=None, tokenizer=None)
    summary_path_for(part).write_text(json.dumps({"summary": {}, "render": {"t": 2}}))
    with pytest.raises(ValueError, match="rendered with different chat templates"):
        demo.prepare_demo_data(cfg, prepared, target_model=None, tokenizer=None)


def test_demo_refuses_prepared_data_of_another_mix(tmp_path):
    """A prepared.jsonl left in the output folder by a run with other sizes (or another recipe) is refused,
    not trained on."""
    from deepspec import demo

    cfg = demo.DemoConfig(output_dir=str(tmp_path), num_conversations=4, num_gsm8k_conversations=0,
                          num_mbpp_conversations=0)
    prepared = tmp_path / "prepared.jsonl"
    prepared.write_text("")
    with pytest.raises(ValueError, match=r"holds another training mix \(no demo data summary\) than this demo asks "
                                         r"for \(sharegpt 4\); use another --output-dir"):
        demo.check_reused_prepared(cfg, prepared)
    summary = tmp_path / "prepared.jsonl.summary.json"
    summary.write_text(json.dumps({"parts": {"sharegpt": {"conversations_asked": 8}}}))
    with pytest.raises(ValueError, match=r"\(sharegpt 8\) than this demo asks for \(sharegpt 4\)"):
        demo.check_reused_prepared(cfg, prepared)
    summary.write_text(json.dumps({"parts": {"sharegpt": {"conversations_asked": 4}}}))
    demo.check_reused_prepared(cfg, prepared)
