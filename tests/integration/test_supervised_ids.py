"""The embedded SmolLM2: regenerate ShareGPT prompts, build the target cache, and check that every
supervised span is exactly what the target generated.

Supervising ``encode(decode(ids).strip())`` instead would change the tokens: on these three prompts
(64 new tokens) at least one supervised span would lose the trailing whitespace the target generated
(or have ``"\\n\\n"``, id 1116, re-split into ``198 198``), so the prompts exercise the rule.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import mask_spans

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_sharegpt_answers_are_supervised_on_the_generated_ids(tmp_path):
    from deepspec.data.cache import TargetCache, write_target_cache
    from deepspec.data.chat import render_prompt, render_training_samples
    from deepspec.data.online import OnlineTargetFeatures
    from deepspec.data.prepare import PrepareConfig, run_prepare
    from deepspec.target.load import load_target

    model, tok = load_target("default")
    cfg = PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", num_conversations=3, max_new_tokens=64,
                        max_turns=1, batch_size=3, show_progress=False)
    summary = run_prepare(cfg, model, tok, log=lambda _: None)
    assert summary.num_turns_with_ids == summary.num_regenerated_turns == 3
    rows = {r["id"]: r for r in map(json.loads, cfg.output.read_text().splitlines())}
    lossy = 0  # rows the stripped, re-tokenised text would supervise on other tokens
    for row in rows.values():
        generated = row["generated_ids"][-1]
        assert row["messages"][-1]["content"] == tok.decode(generated if row["truncated"] else generated[:-1])
        stripped = [dict(m) for m in row["messages"]]
        stripped[-1]["content"] = stripped[-1]["content"].strip()
        (old,) = render_training_samples(tok, stripped, cut_turns=row["truncated_turns"])
        lossy += [t for t, m in zip(old.input_ids, old.loss_mask) if m] != generated
    assert lossy >= 1  # these prompts are ones where re-tokenising loses the generated tokens

    summary = write_target_cache(cfg.output, tmp_path / "cache", model, tok, target_layer_ids=[1, 8],
                                 max_seq_len=None, storage_dtype="float32", progress=False)
    cache = TargetCache(tmp_path / "cache")
    online = OnlineTargetFeatures(cfg.output, model, tok, target_layer_ids=[1, 8], max_seq_len=None)
    assert len(cache) == len(online) == 3 and summary.turns["num_turns_ids"] == 3
    for i in range(len(cache)):
        row = rows[cache.sample_id(i)]
        ids, mask = cache[i]["input_ids"].tolist(), cache[i]["loss_mask"].tolist()
        ((a, b),) = mask_spans(mask)
        assert ids[:a] == render_prompt(tok, row["messages"][:-1])  # the prompt the target was given
        assert ids[a:b] == row["generated_ids"][-1]  # exactly the ids it generated
        assert online[i]["input_ids"].tolist() == ids and online[i]["loss_mask"].tolist() == mask
