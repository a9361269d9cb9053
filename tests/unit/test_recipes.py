"""Recipes (deepspec/recipes/*.toml): every named recipe is valid for the stages it names, the demo
recipe is what `deepspec demo` runs, the Qwen3 recipes build their drafts from the target's
config.json alone, and `--recipe` on the command line sets defaults that flags override."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.registry import get_algorithm
from deepspec.cli import _config_class, build_parser, main
from deepspec.config import dataclass_from_args
from deepspec.demo import DemoConfig
from deepspec.recipes import load_recipe, recipe_names
from deepspec.train.config import TrainConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# the fields a user always gives on the command line (paths of this run), per stage
PATHS = {
    "prepare": dict(input="in.jsonl", output=Path("out.jsonl")),
    "cache": dict(input="prepared.jsonl", output_dir="cache"),
    "train": dict(cache_dir="cache", output_dir="train"),
    "eval": dict(draft=["train"], output_dir="eval", lookup_corpus=["prepared.jsonl"]),
    "demo": {},
}


def test_named_recipes_are_shipped():
    assert recipe_names() == ["cpu", "demo", "qwen3-14b", "qwen3-4b", "qwen3-8b"]


@pytest.mark.parametrize("name", ["cpu", "demo", "qwen3-14b", "qwen3-4b", "qwen3-8b"])
def test_every_table_of_every_recipe_builds_its_stage_config(name):
    recipe = load_recipe(name)
    assert recipe.description
    stages = set(recipe.sections) - {"common"}
    assert stages <= set(PATHS), f"recipe {name}: tables for unknown stages {stages - set(PATHS)}"
    for stage in stages:
        cls = _config_class(stage)
        settings = recipe.settings(stage, cls)
        given = dict(PATHS[stage])
        if settings.get("backend") == "openai":  # the servers are the user's
            given["base_urls"] = ["http://localhost:8000/v1"]
        if stage == "eval" and settings.get("lookup_first") is None and "ngram+corpus" not in settings.get("baselines", []):
            del given["lookup_corpus"]  # nothing in this recipe's eval reads a corpus
        cfg = cls(**{**settings, **given})  # __post_init__ validates the values together
        for key, value in settings.items():
            assert getattr(cfg, key) == value, (stage, key)


def test_the_demo_recipe_is_what_the_demo_runs(tmp_path):
    """demo.toml's stage tables equal the configs `deepspec demo` builds (and cpu.toml's, with its
    [demo] table), so running the stages one by one with --recipe demo reproduces the demo."""
    for name in ("demo", "cpu"):
        recipe = load_recipe(name)
        demo = DemoConfig(**{**recipe.settings("demo", DemoConfig), "output_dir": str(tmp_path / name)})
        prepared, cache = tmp_path / "prepared.jsonl", tmp_path / "cache"
        built = {
            "prepare": demo.prepare_config("src.jsonl", prepared, 5),
            "cache": demo.cache_config(prepared, cache),
            "train": demo.train_config("dspark", cache),
            "eval": demo.eval_config(["ckpt"], tmp_path / "eval"),
        }
        for stage, expected in built.items():
            paths = {k: getattr(expected, k) for k in ("input", "output", "output_dir", "cache_dir", "draft",
                                                         "num_conversations", "resume", "lookup_corpus")
                     if hasattr(expected, k) and k not in recipe.settings(stage, type(expected))}
            from_recipe = type(expected)(**recipe.settings(stage, type(expected)), **paths)
            assert from_recipe == expected, f"recipe {name} [{stage}] differs from the demo's {stage} config"


@pytest.mark.parametrize("name, layers, hidden", [("qwen3-4b", 36, 2560), ("qwen3-8b", 36, 4096),
                                                  ("qwen3-14b", 40, 5120)])
def test_qwen3_recipes_build_their_draft_from_config_json_alone(name, layers, hidden):
    """docs/design/targets.md, "Targets": the original's targets build and validate from config.json alone (the draft is
    built on the meta device: no weights are read or allocated)."""
    recipe = load_recipe(name)
    assert "target" not in recipe.settings("train", TrainConfig)  # the user's local folder: --target
    target_config = AutoConfig.for_model(**json.loads((FIXTURES / f"{name}-config.json").read_text()))
    tokenizer = types.SimpleNamespace(pad_token_id=151643, eos_token_id=151645, bos_token_id=None)
    cfg = TrainConfig(**recipe.settings("train", TrainConfig), cache_dir="cache", output_dir="train")
    # the draft's config and module, as DSparkAlgorithm.build makes them, without the target's weights
    dc = get_algorithm(cfg.algorithm).draft_config(target_config, target_config.vocab_size, tokenizer, cfg,
                                                   cfg.target_layer_ids)
    with torch.device("meta"):
        draft = DSparkDraftModel(dc)
    assert (dc.num_draft_layers, dc.block_size, dc.mask_token_id, dc.markov_rank) == (5, 7, 151669, 256)
    assert dc.target_num_hidden_layers == layers and dc.hidden_size == hidden
    assert dc.feature_width == 5 * hidden and max(dc.target_layer_ids) <= layers - 3
    assert dc.architecture == "Qwen3DSparkModel" and len(draft.layers) == 5
    assert draft.fc.weight.shape == (hidden, 5 * hidden)
    assert cfg.batch_size * cfg.grad_accum_steps * 8 == 512  # the paper's global batch on 8 ranks


def _parse(argv):
    from deepspec.cli import _split_recipe

    name, rest = _split_recipe(argv)
    args = build_parser(stages=(rest[0],), recipe=load_recipe(name)).parse_args(rest)
    return dataclass_from_args(_config_class(rest[0]), args)


def test_recipe_flag_sets_defaults_and_flags_win():
    cfg = _parse(["train", "--recipe", "qwen3-4b", "--cache-dir", "c", "--output-dir", "o", "--lr", "3e-4"])
    assert (cfg.num_anchors, cfg.block_size, cfg.num_draft_layers, cfg.dtype) == (512, 7, 5, "bf16")
    assert cfg.lr == 3e-4 and cfg.target is None
    cfg = _parse(["train", "--recipe=cpu", "--cache-dir", "c", "--output-dir", "o", "--num-anchors", "4"])
    assert (cfg.block_size, cfg.draft_vocab_size, cfg.num_anchors) == (7, 8192, 4)
    cfg = _parse(["demo", "--recipe", "cpu"])
    assert cfg.algorithms == ["dspark", "dflash", "eagle3"] and cfg.num_gsm8k_conversations == 1536
    cfg = _parse(["eval", "--recipe", "qwen3-4b", "--draft", "d", "--output-dir", "o"])
    assert cfg.num_prompts is None and cfg.temperature == 1.0 and "math500" in cfg.benchmarks


def test_recipe_help_shows_the_recipe_values(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "qwen3-4b", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "recipe qwen3-4b: 512; default: 32" in out and "Qwen3-4B as the DSpark paper trains it" in out


@pytest.mark.parametrize("text, message", [
    ('[train]\nnum_anchor = 3\n', r"recipe r \[train\]\.num_anchor: not a setting of this stage; did you mean num_anchors"),
    ('[train]\nlr = "fast"\n', r"recipe r \[train\]\.lr: expected a number, got 'fast'"),
    ('[train]\nblock_size = 2.5\n', r"\[train\]\.block_size: expected an integer"),
    ('[train]\nheldout_benchmarks = "gsm8k"\n', r"heldout_benchmarks: expected a list"),
    ('lr = 3\n', r"top-level keys \['lr'\] are not allowed"),
    ('[cache]\nmax_seq_len = 8\n', r"has no \[train\] table \(its tables: cache\)"),
    ('[train\n', r"not valid TOML"),
    ('base = "r.toml"\n[train]\n', r"base chain loops \(r -> r\)"),
    ('base = "nope"\n', r"'nope' is neither a named recipe"),
    ('[trian]\nlr = 1.0\n', r"tables \['trian'\] are not stages"),
    ('[common]\ntargte = "x"\n[train]\n', r"\[common\]: \['targte'\] are not settings of any stage"),
    ('[description]\ntext = "x"\n[train]\n', r"tables \['description'\] are not stages"),
])
def test_bad_recipes_are_one_line_errors_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "r.toml"
    path.write_text(text)
    assert main(["train", "--recipe", str(path), "--cache-dir", "c", "--output-dir", "o"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_a_missing_recipe_file_is_named(capsys):
    assert main(["train", "--recipe", "missing.toml", "--cache-dir", "c", "--output-dir", "o"]) == 2
    assert "recipe: no file missing.toml" in capsys.readouterr().err


def test_a_recipe_file_may_extend_a_named_recipe(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "qwen3-4b"\n[common]\ntarget = "/models/my-qwen3"\n[train]\nlr = 1e-4\n')
    cfg = _parse(["train", "--recipe", str(path), "--cache-dir", "c", "--output-dir", "o"])
    assert (cfg.target, cfg.lr, cfg.num_anchors) == ("/models/my-qwen3", 1e-4, 512)


def test_recipe_flag_may_stand_before_the_stage_and_needs_a_value(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "demo", "train", "--help"])
    assert "recipe demo: 3; default: 7" in " ".join(capsys.readouterr().out.split())
    assert main(["train", "--recipe", "--output-dir", "x"]) == 2
    assert "--recipe: expected a recipe name or a .toml file" in capsys.readouterr().err
