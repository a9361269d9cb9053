"""The OpenAI-compatible regeneration backend against real HTTP servers (no mock objects).

Two :class:`OpenAICompatServer` instances run in threads on free ports over the same tiny random
Llama (a byte-level ChatML tokenizer whose template honours ``enable_thinking``). The model's
end-of-turn row copies a frequent token's row (x1.05), so greedy answers stop at varied lengths and
some hit ``max_new_tokens``. Checked: output order = input order although completions arrive out of
order; greedy answers equal the local backend's byte for byte (the server generates batch 1, the
local backend batches with left padding: exact in fp32); injected 500s are retried; a persistent
failure names the row and the server; cut answers are flagged; ``enable_thinking`` reaches the
template. Resume: ``deepspec prepare`` in a subprocess is SIGKILLed once its journal holds rows,
a rerun completes it, and the outputs equal an uninterrupted run's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deepspec.data.backends import BackendError, OpenAIBackend
from deepspec.data.prepare import (
    PrepareConfig,
    heldout_path_for,
    journal_path_for,
    read_journal,
    run_prepare,
    skipped_path_for,
)
from deepspec.serve.openai_server import OpenAICompatServer
from tests.helpers import byte_level_tokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3,
                     "min_p": 0.05}
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _tokenizer():
    return byte_level_tokenizer(THINK_TEMPLATE)


@pytest.fixture(scope="module")
def target(tmp_path_factory, one_thread):
    """(model, tokenizer, folder): a tiny random Llama saved as a target folder for subprocesses."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                         initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # end-of-turn competes with a frequent token: answers of varied length
        model.lm_head.weight[2] = model.lm_head.weight[tok.convert_tokens_to_ids("#")] * 1.05
    # Sampling defaults in the checkpoint (as Qwen3 ships): every path must ignore them (pinned decoding).
    model.generation_config = GenerationConfig(**SAMPLING_DEFAULTS, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    reloaded = AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, enable_thinking=False) \
        == tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    return model, tok, folder


def _rows():
    rows = []
    for i in range(12):
        turns = [("human", f"question {i} " * (i % 3 + 1)), ("gpt", "old answer")]
        if i % 4 == 1:
            turns += [("human", f"follow-up {i}"), ("gpt", "old"), ("human", "again?"), ("gpt", "old")]
        if i == 6:
            turns = [("human", "no answer here")]  # skipped and counted
        rows.append({"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]})
    return rows


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()), encoding="utf-8")
    return path


@pytest.fixture
def servers(target):
    model, tok, _ = target
    started = []

    def start(**kwargs):
        server = OpenAICompatServer(model, tok, model_name="tiny", **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.hold is not None:
            server.hold.set()
        server.stop()


def _cfg(source, output, **overrides):
    knobs = dict(input=str(source), output=output, num_conversations=100, max_new_tokens=8, max_turns=None,
                 max_prompt_tokens=200, batch_size=4, show_progress=False)
    knobs.update(overrides)
    return PrepareConfig(**knobs)


def _read(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


class RecordingBackend(OpenAIBackend):
    """The real OpenAI backend, also recording the order in which answers complete."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completed: list[int] = []

    def generate(self, requests, on_result):
        def record(i, result):
            self.completed.append(i)
            on_result(i, result)

        super().generate(requests, record)


def test_openai_backend_equals_local_in_input_order_with_retries(tmp_path, source, target, servers):
    model, tok, _ = target
    local_cfg = _cfg(source, tmp_path / "local.jsonl")
    local = run_prepare(local_cfg, model, tok, log=lambda _: None)

    a = servers(fail_first=3, delay_s=(0.0, 0.05), delay_seed=1)
    b = servers(delay_s=(0.0, 0.05), delay_seed=2)
    cfg = _cfg(source, tmp_path / "remote.jsonl", backend="openai", base_urls=[a.base_url, b.base_url],
               max_concurrency=2, retry_backoff_s=0.01)
    backend = RecordingBackend(cfg.base_urls, max_concurrency=2, retry_backoff_s=0.01, log=lambda _: None)
    remote = run_prepare(cfg, None, tok, backend=backend, log=lambda _: None)

    assert backend.model == "tiny"  # resolved from GET /v1/models (one model listed)
    assert backend.completed[:11] != sorted(backend.completed[:11])  # round 1 completed out of order
    assert a.num_failed_injected == 3 and remote.num_retries >= 3  # every injected 500 was retried
    assert len(a.prompts) > 0 and len(b.prompts) > 0  # both servers answered
    assert cfg.output.read_bytes() == local_cfg.output.read_bytes()  # same answers, same (input) order
    assert skipped_path_for(cfg.output).read_bytes() == skipped_path_for(local_cfg.output).read_bytes()
    rows = _read(cfg.output)
    assert [r["source_index"] for r in rows] == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert (remote.read, remote.kept, remote.skipped, remote.failed) == (12, 11, 1, 0)
    assert (local.kept, local.truncated) == (remote.kept, remote.truncated)
    assert 0 < remote.truncated < remote.kept  # some answers were cut by max_tokens, some stopped
    for row in rows:
        assistant = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        assert set(row["truncated_turns"]) <= set(assistant) and row["truncated"] == bool(row["truncated_turns"])
        if row["truncated_turns"]:
            assert row["truncated_turns"] == [assistant[-1]]  # a cut answer ends the conversation
    by_src = {r["source_index"]: r for r in rows}
    for i in (1, 5):  # second turns were regenerated on top of the regenerated first answer
        assert [m["role"] for m in by_src[i]["messages"]] == ["user", "assistant", "user", "assistant"]
        second_prompt = by_src[i]["messages"][:3]
        assert any(body["messages"] == second_prompt for body in a.received + b.received)
    for r in rows:  # the user turns are the source's, the answers the target's
        assert "old answer" not in [m["content"] for m in r["messages"]]


def test_cut_answer_is_flagged_and_eot_unsupervised(tmp_path, source, target, servers):
    from deepspec.data.chat import render_training_samples

    model, tok, _ = target
    a = servers()
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[a.base_url], max_new_tokens=3,
               max_turns=1)
    summary = run_prepare(cfg, None, tok, log=lambda _: None)
    rows = _read(cfg.output)
    cut = [r for r in rows if r["truncated"]]
    assert cut and summary.truncated == len(cut)
    for row in cut:  # the server said finish_reason="length": the answer has exactly max_tokens tokens
        answer = row["messages"][row["truncated_turns"][0]]["content"]
        body = next(b for b in a.received if b["messages"][-1]["content"] == row["messages"][-2]["content"])
        assert body["max_tokens"] == 3 and len(answer.encode()) <= 3 * 3
        (sample,) = render_training_samples(tok, row["messages"], cut_turns=row["truncated_turns"])
        eot_positions = [t for t, i in enumerate(sample.input_ids) if i == tok.eos_token_id]
        assert sample.loss_mask[eot_positions[-1]] == 0  # the end-of-turn the target never produced


def test_enable_thinking_reaches_the_template(tmp_path, source, target, servers):
    _, tok, _ = target
    a = servers()
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[a.base_url], num_conversations=2,
               max_turns=1, enable_thinking=False, server_model="tiny")
    run_prepare(cfg, None, tok, log=lambda _: None)
    assert len(a.received) == 2
    assert all(body["chat_template_kwargs"] == {"enable_thinking": False} for body in a.received)
    assert all(tok.decode(p).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in a.prompts)
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in _read(cfg.output))


def test_persistent_failures_name_the_row_and_server(tmp_path, source, target, servers):
    _, tok, _ = target
    broken = servers(fail_first=10_000)
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[broken.base_url], max_retries=2,
               retry_backoff_s=0.01, max_concurrency=1, server_model="tiny")
    with pytest.raises(BackendError, match=rf"in.jsonl:1 \(id c0\) assistant turn 0: server {broken.base_url} "
                                           rf"still failing after 2 retries"):
        run_prepare(cfg, None, tok, log=lambda _: None)
    assert broken.num_failed_injected == 3 and not cfg.output.exists()

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    cfg = _cfg(source, tmp_path / "dead.jsonl", backend="openai", base_urls=[dead], max_retries=1,
               retry_backoff_s=0.01, request_timeout_s=5.0)
    with pytest.raises(BackendError, match=rf"GET {dead}/models: server {dead} still failing.*APIConnectionError"):
        run_prepare(cfg, None, tok, log=lambda _: None)


def test_base_url_without_v1_names_the_url_asked_and_hints_at_v1(tmp_path, source, target, servers):
    _, tok, _ = target
    a = servers()
    root = a.base_url[: -len("/v1")]
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[root], max_retries=0)
    with pytest.raises(BackendError, match=rf"GET {root}/models: server {root} refused the request: Error code: 404"
                                           rf".*Hint: OpenAI-compatible base URLs usually end in /v1 "
                                           rf"\(e\.g\. http://host:8000/v1\)") as info:
        run_prepare(cfg, None, tok, log=lambda _: None)
    assert "--server-model" not in str(info.value)
    cfg = _cfg(source, tmp_path / "out2.jsonl", backend="openai", base_urls=[root], max_retries=0,
               server_model="tiny")
    with pytest.raises(BackendError, match=r"assistant turn 0: server .* 404.*Hint: OpenAI-compatible base URLs"):
        run_prepare(cfg, None, tok, log=lambda _: None)


def test_unknown_model_is_refused_with_404_like_vllm(tmp_path, source, target, servers):
    import urllib.error
    import urllib.request

    _, tok, _ = target
    a = servers()
    request = urllib.request.Request(f"{a.base_url}/chat/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "nope", "messages": [
                                         {"role": "user", "content": "hi"}]}).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 404
    assert json.loads(info.value.read())["error"]["message"] == "The model `nope` does not exist."
    assert a.num_chat_requests == 1 and not a.prompts  # refused before generation
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[a.base_url], max_retries=0,
               server_model="nope")
    with pytest.raises(BackendError, match=r"The model `nope` does not exist.*Hint: check --server-model against "
                                           rf"the names listed by GET {a.base_url}/models") as info:
        run_prepare(cfg, None, tok, log=lambda _: None)
    assert "/v1 (e.g." not in str(info.value) and not cfg.output.exists()


def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, source, target, servers):
    _, tok, folder = target
    hold = threading.Event()
    a = servers(hold=hold, hold_after=3, delay_s=(0.0, 0.02))
    b = servers(hold=hold, hold_after=3, delay_s=(0.0, 0.02))
    out = tmp_path / "out.jsonl"
    knobs = dict(max_turns=1, heldout_fraction=0.25, split_seed=1, backend="openai",
                 base_urls=[a.base_url, b.base_url], max_concurrency=1, target=str(folder))
    cmd = [sys.executable, "-m", "deepspec.cli", "prepare", "--input", str(source), "--output", str(out),
           "--num-conversations", "100", "--max-new-tokens", "8", "--max-prompt-tokens", "200",
           "--max-turns", "1", "--heldout-fraction", "0.25", "--split-seed", "1", "--backend", "openai",
           "--base-urls", a.base_url, b.base_url, "--max-concurrency", "1", "--target", str(folder),
           "--show-progress", "false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    journal = journal_path_for(out)
    deadline = time.monotonic() + 180
    try:
        # Each server answers 3 requests, then holds the next: the journal stops at 6 finished rows.
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"prepare exited early: {proc.stdout.read().decode()[-2000:]}")
            if journal.exists() and len(journal.read_bytes().splitlines()) >= 1 + 6:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the journal never reached 6 rows")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    hold.set()
    assert not out.exists() and not heldout_path_for(out).exists()
    _, entries = read_journal(journal)
    assert len(entries) == 6

    resumed = run_prepare(_cfg(source, out, **knobs), None, tok, log=lambda _: None)
    fresh_out = tmp_path / "fresh" / "out.jsonl"
    fresh = run_prepare(_cfg(source, fresh_out, **knobs), None, tok, log=lambda _: None)
    assert resumed.num_resumed == 6 and fresh.num_resumed == 0 and not journal.exists()
    assert resumed.num_regenerated_turns == fresh.num_regenerated_turns - 6
    for path, fresh_path in ((out, fresh_out), (heldout_path_for(out), heldout_path_for(fresh_out)),
                             (skipped_path_for(out), skipped_path_for(fresh_out))):
        assert path.read_bytes() == fresh_path.read_bytes(), path
    train, heldout = _read(out), _read(heldout_path_for(out))
    assert heldout and len(train) + len(heldout) == resumed.kept == 11
    assert [r["source_index"] for r in train] == sorted(r["source_index"] for r in train)


def test_sampling_parameters_are_sent_per_request_and_reproducible(tmp_path, source, target, servers):
    _, tok, _ = target
    a = servers()
    outputs = []
    for name in ("s1.jsonl", "s2.jsonl"):
        cfg = _cfg(source, tmp_path / name, backend="openai", base_urls=[a.base_url], max_turns=1,
                   num_conversations=4, temperature=0.8, top_p=0.9, seed=5)
        run_prepare(cfg, None, tok, log=lambda _: None)
        outputs.append(cfg.output.read_bytes())
    bodies = a.received[:4]
    assert all(b["temperature"] == 0.8 and b["top_p"] == 0.9 and b["max_tokens"] == 8 for b in bodies)
    assert len({b["seed"] for b in bodies}) == 4  # one seed per (row, turn)
    assert sorted(b["seed"] for b in a.received[4:]) == sorted(b["seed"] for b in bodies)
    assert outputs[0] == outputs[1]  # a server that honours `seed` reproduces sampled answers


def test_every_request_pins_decoding_and_asks_for_token_ids(tmp_path, source, target, servers):
    """Greedy and sampled requests carry every decoding setting (so a vLLM/SGLang server applies none of
    the checkpoint's generation_config defaults), the stop rule's ids and return_token_ids; the
    generated ids come back, are stored per turn, and are the local backend's."""
    model, tok, folder = target
    a = servers()
    cfg = _cfg(source, tmp_path / "greedy.jsonl", backend="openai", base_urls=[a.base_url], max_turns=1,
               num_conversations=3, target=str(folder))
    summary = run_prepare(cfg, None, tok, log=lambda _: None)
    pinned = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop_token_ids": [2], "return_token_ids": True,
              "max_tokens": 8}
    for body in a.received:
        assert {k: body.get(k) for k in pinned} == pinned and "seed" not in body
    assert summary.num_turns_with_ids == summary.num_regenerated_turns > 0 and summary.num_turns_text_only == 0
    local_cfg = _cfg(source, tmp_path / "local.jsonl", max_turns=1, num_conversations=3)
    run_prepare(local_cfg, model, tok, log=lambda _: None)
    assert cfg.output.read_bytes() == local_cfg.output.read_bytes()  # generated_ids included
    for row in _read(cfg.output):
        ids = row["generated_ids"][1]
        assert ids[-1] == 2 or row["truncated"]
        assert tok.decode(ids[:-1] if ids[-1] == 2 else ids, skip_special_tokens=True) == row["messages"][1]["content"]
    recorded = json.loads((tmp_path / "greedy.jsonl.summary.json").read_text())["decoding"]
    assert recorded["checkpoint_settings_ignored"]["repetition_penalty"] == 1.3  # read from the target folder

    cfg = _cfg(source, tmp_path / "sampled.jsonl", backend="openai", base_urls=[a.base_url], max_turns=1,
               num_conversations=2, temperature=0.7, top_k=5, top_p=0.9, seed=3, target=str(folder))
    run_prepare(cfg, None, tok, log=lambda _: None)
    for body in a.received[-2:]:
        assert {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")} == \
            {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}
        assert isinstance(body["seed"], int)


def test_server_without_token_ids_gives_text_only_turns(tmp_path, source, target, servers):
    _, tok, _ = target
    a = servers(token_ids=False)
    cfg = _cfg(source, tmp_path / "out.jsonl", backend="openai", base_urls=[a.base_url], max_turns=1,
               num_conversations=3)
    summary = run_prepare(cfg, None, tok, log=lambda _: None)
    assert summary.num_turns_text_only == summary.num_regenerated_turns > 0 and summary.num_turns_with_ids == 0
    assert all("generated_ids" not in row for row in _read(cfg.output))


def test_serve_refuses_penalties_it_does_not_apply(target, servers):
    import urllib.error
    import urllib.request

    a = servers()
    for field, value in (("repetition_penalty", 1.3), ("min_p", 0.05), ("presence_penalty", 0.5)):
        request = urllib.request.Request(f"{a.base_url}/chat/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", field: value, "messages": [
                                             {"role": "user", "content": "hi"}]}).encode())
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 400 and field in json.loads(info.value.read())["error"]["message"]
    assert not a.prompts  # refused before generation, never silently ignored
