import json
from types import SimpleNamespace

import pytest

from deepspec.algorithms.registry import ALGORITHMS, algorithm_of_draft, get_algorithm
from deepspec.checkpoints import draft_folder
from deepspec.decoding.settings import unique_name as _unique_name
from deepspec.train.draft import check_resume_shape


def test_registry_lists_the_three_algorithms_and_refuses_unknown_names():
    assert {"dspark", "dflash", "eagle3"} <= set(ALGORITHMS)
    with pytest.raises(ValueError, match="expected one of"):
        get_algorithm("medusa")


def test_algorithm_of_draft_refuses_folders_no_draft_wrote(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="not a DeepSpec draft"):
        algorithm_of_draft(tmp_path / "target")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"deepspec_algorithm": "medusa"}))
    with pytest.raises(ValueError, match="not registered"):
        algorithm_of_draft(tmp_path / "odd")
    with pytest.raises(FileNotFoundError):
        algorithm_of_draft(tmp_path / "missing")


def test_a_draft_config_without_deepspec_algorithm_is_refused_with_the_fix(tmp_path):
    """Loading and resuming name the missing field and say how to add it."""
    draft = tmp_path / "checkpoint-000002" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(json.dumps(
        {"draft_config": {"use_markov_head": False, "use_confidence_head": False}}))
    with pytest.raises(ValueError, match=r"no 'deepspec_algorithm' field.*add \"deepspec_algorithm\": \"dspark\".*"
                                         r"re-save the draft"):
        algorithm_of_draft(draft)
    with pytest.raises(ValueError, match=r"train.resume: .*config.json has no 'deepspec_algorithm' field; add "
                                         r"\"deepspec_algorithm\": \"dflash\""):
        check_resume_shape(draft.parent, None, SimpleNamespace(algorithm="dflash"))


def test_draft_folder_follows_a_run_folders_latest_pointer(tmp_path):
    draft = tmp_path / "run" / "checkpoint-000004" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    (tmp_path / "run" / "latest").write_text("checkpoint-000004\n")
    assert draft_folder(tmp_path / "run") == draft
    assert draft_folder(tmp_path / "run" / "checkpoint-000004") == draft
    assert draft_folder(draft) == draft


def test_report_names_never_collide():
    taken = {"dspark:a/checkpoint-000004": 1}
    assert _unique_name("eagle3:b/checkpoint-000004", taken) == "eagle3:b/checkpoint-000004"
    assert _unique_name("dspark:a/checkpoint-000004", taken) == "dspark:a/checkpoint-000004#2"
