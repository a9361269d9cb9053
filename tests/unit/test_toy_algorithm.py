"""An algorithm is its folder and its registry line (CONTRIBUTING.md, "Adding a drafting algorithm"): a toy
algorithm registered here, and nowhere else, gets its options as `deepspec train` flags (with their --help
text, checks and the warnings / refusals of other algorithms' options) and its format in `deepspec export`
(dispatch, the shared tensor check, the atomic write), with no shared file naming it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from deepspec.algorithms.protocol import DraftOptions, TrainingShape, option
from deepspec.algorithms.registry import ALGORITHMS
from deepspec.cli import _config_class, build_parser, main
from deepspec.config import dataclass_from_args
from deepspec.export import ExportConfig, build_export, check_export
from deepspec.models.config import save_draft_folder
from deepspec.models.engine_layout import ExportError, ExportFormat
from deepspec.train.config import TrainConfig, train_config_class

PACKAGE = Path(__file__).resolve().parents[2] / "deepspec"


@dataclass(kw_only=True)
class ToyOptions(DraftOptions):
    """The toy's training options."""

    # -- Toy --
    toy_steps: int = option(2, elsewhere="has no toy steps (only toy has them)")  # toy steps per proposal
    # whether the toy starts from the target (another algorithm refuses it)
    toy_warm_start: bool = option(False, elsewhere="warm-starts a toy draft", refused_elsewhere=True)


@dataclass
class ToyConfig:
    family: str = "llama"
    toy_steps: int = 2
    draft_vocab_size: int | None = None
    target_fingerprint: str | None = "f" * 64
    target_layer_ids: list[int] = dataclasses.field(default_factory=lambda: [0])

    def to_dict(self):
        return dataclasses.asdict(self)


class ToyDraft(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(4, 3, bias=False)

    def save_pretrained(self, path):
        config = {"deepspec_algorithm": "toy", "toy_config": self.config.to_dict()}
        return save_draft_folder(path, self.state_dict(), config)

    @classmethod
    def from_pretrained(cls, path):
        config = json.loads((Path(path) / "config.json").read_text())["toy_config"]
        model = cls(ToyConfig(**config))
        model.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
        return model


def _write_toy_engine(model, *, algorithm, verifier=None):
    config = {"architectures": ["ToyEngineDraft"], "toy_steps": model.config.toy_steps}
    return config, {"toy.fc.weight": model.fc.weight}, f"toy-serve DIR --steps {model.config.toy_steps}"


class ToyAlgorithm:
    name = "toy"
    Options = ToyOptions
    export_formats = {"toy-engine": ExportFormat(write=_write_toy_engine,
                                                 expected=lambda config: {"toy.fc.weight": (3, 4)})}

    def check_options(self, options):
        if options.toy_steps < 1:
            raise ValueError(f"train.toy_steps: expected an integer >= 1, got {options.toy_steps}")

    def ignored_options(self, options):
        return ()

    def training_shape(self, options):
        return TrainingShape(proposal_len=options.toy_steps, rows=f"toy x {options.toy_steps}")

    def build(self, target_model, tokenizer, options, target_layer_ids, *, d2t=None):
        return ToyDraft(ToyConfig(toy_steps=options.toy_steps))

    def load(self, path):
        return ToyDraft.from_pretrained(path)

    def owns(self, model):
        return isinstance(model, ToyDraft)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "toy", ToyAlgorithm)
    yield
    monkeypatch.undo()
    assert "toy_steps" not in {f.name for f in dataclasses.fields(train_config_class())}  # gone with it


def test_no_shared_file_names_the_toy():
    assert not [p for p in PACKAGE.rglob("*.py") if "toy" in p.read_text(encoding="utf-8").lower()]


def test_its_options_are_train_flags(toy, capsys):
    stage = build_parser(stages=("train",)).stage_parsers["train"]
    helps = {a.dest: a.help for a in stage._actions}
    assert helps["toy_steps"] == "toy steps per proposal (default: 2)"
    assert "whether the toy starts from the target" in helps["toy_warm_start"]
    assert any(g.title == "Toy" and "--toy-steps" in [a.option_strings[0] for a in g._group_actions]
               for g in stage._action_groups)
    args = build_parser(stages=("train",)).parse_args(["train", "--algorithm", "toy", "--toy-steps", "5",
                                                       "--cache-dir", "c", "--output-dir", "o"])
    cfg = dataclass_from_args(_config_class("train"), args)
    assert cfg.options == ToyOptions(toy_steps=5) and cfg.algorithm == "toy"
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["toy_steps"] == 5  # train_config.json records it
    # its checks, and the other algorithms' options: DSpark's block ignored with a warning, its loss refused
    assert main(["train", "--algorithm", "toy", "--toy-steps", "0", "--cache-dir", "c", "--output-dir", "o"]) == 2
    assert "train.toy_steps: expected an integer >= 1, got 0" in capsys.readouterr().err
    cls = train_config_class()
    warned = cls(cache_dir="c", output_dir="o", algorithm="toy", block_size=3)
    assert warned.ignored_option_warnings() == [
        "--block-size 3 is ignored: a toy draft has no draft blocks (only dspark and dflash have them)"]
    with pytest.raises(ValueError, match=r"train.ce_weight: sets the DSpark / DFlash loss; toy has its own options "
                                         r"\(--toy-steps, --toy-warm-start\): drop --ce-weight"):
        cls(cache_dir="c", output_dir="o", algorithm="toy", ce_weight=1.0)
    # ... and the other way round
    assert cls(cache_dir="c", output_dir="o", toy_steps=4).ignored_option_warnings() == [
        "--toy-steps 4 is ignored: a dspark draft has no toy steps (only toy has them)"]
    with pytest.raises(ValueError, match="train.toy_warm_start: warm-starts a toy draft; eagle3 has its own options"):
        cls(cache_dir="c", output_dir="o", algorithm="eagle3", toy_warm_start=True)
    # the config class built before the toy was registered says how to get one that knows it
    with pytest.raises(ValueError, match="toy's options .* are not fields of this TrainConfig.*train_config_class"):
        TrainConfig(cache_dir="c", output_dir="o", algorithm="toy")


def test_its_format_is_an_export_format(toy, tmp_path, capsys):
    torch.manual_seed(0)
    folder = ToyDraft(ToyConfig(toy_steps=3)).save_pretrained(tmp_path / "toy-draft")
    out = tmp_path / "exported"
    assert main(["export", "--draft", str(folder), "--format", "toy-engine", "--output-dir", str(out),
                 "--dtype", "float32"]) == 0
    assert "serve it with: toy-serve " + str(out) + " --steps 3" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["ToyEngineDraft"] and config["deepspec"]["algorithm"] == "toy"
    assert config["deepspec"]["config"]["toy_steps"] == 3
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["toy.fc.weight"], ToyDraft.from_pretrained(folder).fc.weight)
    # the shared tensor check guards its layout too
    config, weights, _ = build_export(folder, "toy-engine")
    with pytest.raises(ExportError, match=r"toy-engine: the export does not match .*wrong shapes toy.fc.weight"):
        check_export("toy-engine", config, {"toy.fc.weight": torch.zeros(4, 4)})
    # a format the toy does not carry is refused naming its own; its format takes only toy drafts
    with pytest.raises(ExportError, match=r"vllm-eagle3: the draft is a toy draft; use --format toy-engine "
                                          r"\(vllm-eagle3 takes eagle3 drafts\)"):
        build_export(folder, "vllm-eagle3")
    with pytest.raises(ValueError, match="drop --verifier"):
        ExportConfig(draft=str(folder), format="toy-engine", output_dir=str(tmp_path / "x"), verifier="default")


def test_an_unregistered_format_is_no_format(tmp_path):
    with pytest.raises(ValueError, match="export.format: expected one of .*, got 'toy-engine'"):
        ExportConfig(draft="d", format="toy-engine", output_dir=str(tmp_path / "x"))
