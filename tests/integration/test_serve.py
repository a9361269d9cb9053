"""``deepspec serve --draft``: speculative decoding behind the OpenAI-compatible server.

A tiny random Llama target (byte-level ChatML tokenizer, ``<repo_name>`` as the draft's mask token)
is served by :class:`OpenAICompatServer` in a thread on a free port, decoding through
:class:`EngineDecoder`: target-only, and with a saved DSpark / Eagle3 draft made for it. Requests go
through the real ``openai`` client. Checked: greedy answers (text and ids) equal the local backend's
(Hugging Face ``generate``) with every draft, streamed or not; the streamed chunks concatenate to
the non-streamed text and end with ``[DONE]``; a seeded sampled request repeats exactly; usage and
the per-request acceptance figures are consistent (``tau`` = (accepted + steps) / steps, at most
``num_speculative_tokens`` drafts a step); bad or unsupported requests get a 400 naming the field,
before any decoding; a client that closes its connection stops its request at the next step. With the
engine held on an event (deterministic): requests are decoded in arrival order, a full queue answers 503
with ``Retry-After`` (a bad request still gets its 400), a client that leaves the queue is never decoded;
a decoding error is answered 500 and the server goes on.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from deepspec.cli import main
from deepspec.data.backends import GenerationParams, LocalBackend
from deepspec.data.chat import render_prompt
from deepspec.serve.decoder import EngineDecoder
from deepspec.serve.openai_server import OpenAICompatServer
from deepspec.target import load
from deepspec.target.decoding import SamplingParams
from tests.helpers import byte_level_tokenizer

try:
    from tests.unit.test_chat import CHATML
except ImportError:  # pytest run from another folder
    from test_chat import CHATML

pytestmark = pytest.mark.usefixtures("one_thread")
openai = pytest.importorskip("openai")
MESSAGES = [[{"role": "user", "content": "Say something about the sea."}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ?"}]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target, tokenizer, {algorithm: saved draft folder})."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepspec.train.config import TrainConfig
    from deepspec.train.draft import build_draft

    tok = byte_level_tokenizer(CHATML, extra_specials=("<repo_name>",))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    target = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # the end-of-turn token competes with a frequent byte: answers of varied length
        target.lm_head.weight[tok.eos_token_id] = target.lm_head.weight[tok.convert_tokens_to_ids("e")] * 1.02
    root = tmp_path_factory.mktemp("drafts")
    folders = {}
    for algorithm in ("dspark", "eagle3"):
        train_cfg = TrainConfig(output_dir=str(root), cache_dir=str(root), algorithm=algorithm, markov_rank=8,
                                block_size=4, ttt_steps=4, mask_token="<repo_name>")
        torch.manual_seed(0)
        folders[algorithm] = build_draft(target, tok, train_cfg, [0, 2]).save_pretrained(root / algorithm)
    return target, tok, folders


@pytest.fixture
def serve(setup):
    target, tok, _ = setup
    started = []

    def start(draft=None, **kwargs):
        decoder = EngineDecoder(target, tok, draft=draft, dtype="float32", **kwargs)
        server = OpenAICompatServer(decoder.target_model, tok, model_name="tiny", decoder=decoder).start()
        started.append(server)
        return server, openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)

    yield start
    for server in started:
        server.stop()


def _local_answers(setup, max_new_tokens: int):
    target, tok, _ = setup
    backend = LocalBackend(target, tok, batch_size=1)
    return [backend.answer_one(m, GenerationParams(max_new_tokens=max_new_tokens))[0] for m in MESSAGES]


def _create(client, messages, **kwargs):
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny", messages=messages, extra_body=extra, **kwargs)


@pytest.mark.parametrize("draft", [None, "dspark", "dspark@fixed", "eagle3", "dspark+lookup", "dspark+lookup+corpus"])
def test_greedy_answers_equal_the_local_backends_streamed_or_not(setup, serve, draft):
    """Lossless under either schedule; with ``fixed`` a repeated request repeats its steps too (with ``auto`` the
    shared scheduler has learnt from the first request and may verify less)."""
    from deepspec.algorithms.ngram.corpus import NGramCorpus

    _, _, folders = setup
    draft, _, schedule = (draft or "").partition("@")
    draft = draft or None
    wanted = _local_answers(setup, 40)
    lookup = {"lookup_first": 1, "lookup_num_tokens": 6} if draft and "+lookup" in draft else {}
    if draft and draft.endswith("+corpus"):  # the target's own answers: the corpus proposes often
        lookup.update(corpus=NGramCorpus([w.token_ids for w in wanted]), corpus_ngram_min=2)
    draft = draft and draft.split("+")[0]
    server, client = serve(None if draft is None else folders[draft], schedule=schedule or "auto", **lookup)
    for messages, want in zip(MESSAGES, wanted):
        answer = _create(client, messages, max_tokens=40, temperature=0)
        choice = answer.choices[0]
        assert choice.message.content == want.text
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == ("length" if want.cut else "stop")
        assert answer.usage.completion_tokens == len(want.token_ids)
        stats = answer.model_extra["deepspec"]
        steps = stats["num_verify_steps"]
        assert 1 <= steps <= len(want.token_ids) - 1
        assert stats["tau"] == pytest.approx(stats["num_committed_tokens"] / steps)
        # every step commits accepted + 1 tokens, but the one that ends at an accepted EOS (no bonus token)
        assert stats["num_accepted_tokens"] + steps - stats["num_committed_tokens"] in (0, 1)
        assert stats["num_draft_tokens"] <= steps * stats["num_speculative_tokens"]
        if draft is None:
            assert stats["draft"] is None and stats["num_draft_tokens"] == 0 and stats["tau"] == 1.0
            assert steps == len(want.token_ids) - 1
        else:
            assert stats["draft"].startswith(f"{draft}:")
            assert stats["num_speculative_tokens"] == (6 if lookup else 4)
            assert (stats["lookup_first"], stats["num_lookup_tokens"]) == ((1, 6) if lookup else (None, None))

        chunks = list(_create(client, messages, max_tokens=40, temperature=0, stream=True,
                              stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        last = [c for c in chunks if c.choices][-1]
        assert last.choices[0].finish_reason == choice.finish_reason
        assert last.choices[0].model_extra["token_ids"] == want.token_ids
        if schedule == "fixed" or draft is None:
            assert last.model_extra["deepspec"]["num_verify_steps"] == steps
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_the_stream_is_server_sent_events_ending_with_done(setup, serve):
    server, _ = serve(setup[2]["dspark"])
    body = json.dumps({"model": "tiny", "messages": MESSAGES[0], "max_tokens": 12, "stream": True}).encode()
    request = urllib.request.Request(server.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = [line for line in response.read().decode().split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_seeded_sampled_request_repeats_and_the_cap_holds(setup, serve):
    """With the fixed schedule a seed fixes the text. (With ``auto`` the steps the scheduler chooses, from timings
    and the acceptance seen so far, decide which draws are used: the same distribution, not the same text.)"""
    server, client = serve(setup[2]["dspark"], num_draft_tokens=2, schedule="fixed")
    kw = dict(max_tokens=30, temperature=1.0, seed=7)
    first, second = (_create(client, MESSAGES[0], **kw) for _ in range(2))
    assert first.choices[0].model_extra["token_ids"] == second.choices[0].model_extra["token_ids"]
    streamed = "".join(c.choices[0].delta.content or "" for c in _create(client, MESSAGES[0], stream=True, **kw)
                       if c.choices)
    assert streamed == first.choices[0].message.content
    stats = first.model_extra["deepspec"]
    assert stats["num_speculative_tokens"] == 2
    assert stats["num_draft_tokens"] <= 2 * stats["num_verify_steps"]


def _post(server, payload) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("payload,needle,param", [
    ({"n": 2}, "n=2", "n"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3", "repetition_penalty"),
    ({"stop_token_ids": "x"}, "stop_token_ids", "stop_token_ids"),
    ({"stop_token_ids": [10 ** 6]}, "stop_token_ids=[1000000]", "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, "shorten the conversation", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role='robot'", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts", "messages"),
    ({"max_tokens": -3}, "max_tokens=-3", "max_tokens"),
    ({"max_tokens": 0}, "max_tokens=0", "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens=2.5", "max_tokens"),
    ({"max_tokens": True}, "max_tokens=True", "max_tokens"),
    ({"seed": "abc"}, "seed='abc'", "seed"),
    ({"seed": 2 ** 70}, "seed=", "seed"),
    ({"temperature": "hot"}, "temperature='hot'", "temperature"),
    ({"top_p": 0}, "top_p=0", "top_p"),
    ({"top_k": -5}, "top_k=-5", "top_k"),
    ({"stream": "yes"}, "stream='yes'", "stream"),
    ({"stop": ["\n"]}, "stop strings are not supported", "stop"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool calling", "tools"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "chat_template_kwargs"),
])
def test_unsupported_requests_are_refused_naming_the_field(setup, serve, payload, needle, param):
    server, _ = serve(setup[2]["dspark"])
    status, body = _post(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 4, **payload})
    assert status == 400, body
    assert needle in body["error"]["message"] and body["error"]["param"] == param
    assert server.num_chat_requests == 1 and not server.prompts  # refused before any decoding


def test_text_content_parts_are_the_joined_string(setup, serve):
    server, _ = serve()
    parts = [{"type": "text", "text": "Say something"}, {"type": "text", "text": "about the sea."}]
    as_parts = _post(server, {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": parts}]})
    as_text = _post(server, {"model": "tiny", "max_tokens": 6,
                             "messages": [{"role": "user", "content": "Say something\nabout the sea."}]})
    assert as_parts[0] == 200 and as_parts[1]["choices"] == as_text[1]["choices"]
    assert server.prompts[0] == server.prompts[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_stops_its_request_at_the_next_step(setup, serve, stream):
    """The request is held until its client has closed the connection; then it decodes one step at most
    (the engine hands on_tokens the first token and the check finds the closed socket; a stream may fail
    earlier, writing its headers) and frees the queue (the answer runs for many steps otherwise)."""
    target, tok, folders = setup
    hold = threading.Event()
    decoder = EngineDecoder(target, tok, draft=folders["dspark"], dtype="float32")
    server = OpenAICompatServer(decoder.target_model, tok, model_name="tiny", decoder=decoder, hold=hold).start()
    steps = []
    generate = decoder.generate

    def counting(*args, on_tokens, **kwargs):
        return generate(*args, on_tokens=lambda new: (steps.append(new), on_tokens(new)), **kwargs)

    decoder.generate = counting
    try:
        payload = json.dumps({"model": "tiny", "messages": MESSAGES[0], "max_tokens": 200, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            deadline = time.monotonic() + 60
            while not server.received and time.monotonic() < deadline:  # the request is read and held
                time.sleep(0.01)
        hold.set()
        while not server.num_abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_abandoned == 1 and len(steps) <= 1
        status, body = _post(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


def _blocked(setup, **kwargs):
    """A started target-only server (``kwargs`` to :class:`OpenAICompatServer`) whose decoder waits on an event
    before each generation: (server, the event, the ``max_new_tokens`` of each generation started, in order)."""
    target, tok, _ = setup
    decoder = EngineDecoder(target, tok, dtype="float32")
    server = OpenAICompatServer(decoder.target_model, tok, model_name="tiny", decoder=decoder, **kwargs).start()
    gate, started = threading.Event(), []
    generate = server.decoder.generate

    def blocked(*args, **kwargs):
        started.append(kwargs["max_new_tokens"])
        gate.wait(60)
        return generate(*args, **kwargs)

    server.decoder.generate = blocked
    return server, gate, started


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _post_in_thread(server, payload, answers: dict, key) -> threading.Thread:
    """POST ``payload`` from a thread; ``answers[key]``: (status, the JSON body, or a stream's last event)."""
    def post():
        if not payload.get("stream"):
            answers[key] = _post(server, payload)
            return
        request = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            lines = [line for line in response.read().decode().split("\n") if line]
            answers[key] = response.status, json.loads(lines[-2][len("data: "):])

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_full_queue_is_answered_503_with_retry_after(setup):
    """One request decodes (held on an event) and one waits: with --max-queued-requests 1 the next is refused
    at once with 503, ``Retry-After`` and an OpenAI error, while a bad request still gets its 400 naming the
    field; once the engine is free both admitted requests are answered."""
    server, gate, started = _blocked(setup, max_queued_requests=1)
    answers: dict = {}
    try:
        threads = [_post_in_thread(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 3}, answers, 0)]
        _until(lambda: started == [3])  # decoding (held)
        threads.append(_post_in_thread(server, {"model": "tiny", "messages": MESSAGES[1], "max_tokens": 4}, answers, 1))
        _until(lambda: server.queue.num_waiting == 1)
        request = urllib.request.Request(server.base_url + "/chat/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "messages": MESSAGES[0]}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) >= 1
        error = json.loads(refused.value.read())["error"]
        assert error["type"] == "server_overloaded" and error["code"] == 503
        assert "1 requests wait" in error["message"] and "--max-queued-requests" in error["message"]
        status, body = _post(server, {"model": "tiny", "messages": MESSAGES[0], "top_p": 0})
        assert status == 400 and body["error"]["param"] == "top_p"
        assert server.num_refused_full == 1 and started == [3]
    finally:
        gate.set()
        for thread in threads:
            thread.join(60)
        server.stop()
    assert [answers[i][0] for i in (0, 1)] == [200, 200] and started == [3, 4]
    assert [answers[i][1]["usage"]["completion_tokens"] <= n for i, n in ((0, 3), (1, 4))] == [True, True]


def test_requests_are_decoded_in_arrival_order(setup):
    """Requests that arrive while the engine is busy are decoded first come, first served (each request is
    told apart by its max_tokens; each arrives once the one before it waits)."""
    server, gate, started = _blocked(setup)
    answers: dict = {}
    order = [2, 7, 3, 6, 4, 5]
    threads = []
    try:
        for i, max_tokens in enumerate(order):
            threads.append(_post_in_thread(server, {"model": "tiny", "messages": MESSAGES[i % 2],
                                                    "max_tokens": max_tokens, "stream": i % 2 == 1}, answers, i))
            _until(lambda: started == order[:1] if i == 0 else server.queue.num_waiting == i)
    finally:
        gate.set()
        for thread in threads:
            thread.join(60)
        server.stop()
    assert started == order and len(server.prompts) == len(order)
    assert [answers[i][0] for i in range(len(order))] == [200] * len(order)
    assert [answers[i][1]["choices"][0]["finish_reason"] in ("stop", "length") for i in range(len(order))] \
        == [True] * len(order)


def test_a_client_that_leaves_the_queue_is_never_decoded(setup):
    """A request waiting behind a busy engine whose client closes the connection leaves the queue at once:
    its place frees before the engine does, and it is never decoded."""
    server, gate, started = _blocked(setup, max_queued_requests=1)
    answers: dict = {}
    try:
        first = _post_in_thread(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 3}, answers, 0)
        _until(lambda: started == [3])
        payload = json.dumps({"model": "tiny", "messages": MESSAGES[1], "max_tokens": 9}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            _until(lambda: server.queue.num_waiting == 1)
        _until(lambda: server.num_abandoned == 1 and server.queue.num_waiting == 0)  # the engine is still held
        second = _post_in_thread(server, {"model": "tiny", "messages": MESSAGES[1], "max_tokens": 4}, answers, 1)
        _until(lambda: server.queue.num_waiting == 1)  # the freed place
    finally:
        gate.set()
        first.join(60)
        second.join(60)
        server.stop()
    assert started == [3, 4] and [answers[i][0] for i in (0, 1)] == [200, 200]


def test_a_decoding_error_is_answered_500_and_the_server_goes_on(setup, serve, capsys):
    """An exception while decoding: a 500 in OpenAI's format naming it (streamed: an error event, then
    ``[DONE]``); the next request is answered."""
    server, _ = serve()
    generate = server.decoder.generate
    server.decoder.generate = lambda *a, **k: (_ for _ in ()).throw(FloatingPointError("nan logits"))
    status, body = _post(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 4})
    assert status == 500 and body["error"]["message"] == "decoding failed: FloatingPointError: nan logits"
    answers: dict = {}
    _post_in_thread(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 4, "stream": True},
                    answers, 0).join(60)
    assert answers[0] == (200, {"error": {"message": "decoding failed: FloatingPointError: nan logits",
                                          "type": "server_error", "param": None, "code": 500}})
    assert "FloatingPointError: nan logits" in capsys.readouterr().err  # the traceback, for the operator
    server.decoder.generate = generate
    assert _post(server, {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 4})[0] == 200


def test_the_engine_decoder_refuses_a_draft_for_another_target(setup):
    target, tok, folders = setup
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match="target"):
        EngineDecoder(other, tok, draft=folders["dspark"])
    decoder = EngineDecoder(target, tok, draft=folders["dspark"], num_draft_tokens=1)
    result = decoder.generate(render_prompt(tok, MESSAGES[0]), max_new_tokens=5, sampling=SamplingParams())
    assert len(result.output_ids) <= 5 and result.num_draft_tokens <= result.num_verify_steps


def test_the_engine_decoder_with_draft_trees_matches_target_only(setup):
    """--tree-width 2 with prompt lookup in front: requests verify trees (the lookup's match beside a DSpark
    tree); greedy ones answer exactly what target-only decoding does (float32), sampled ones verify trees too."""
    target, tok, folders = setup
    plain = EngineDecoder(target, tok, dtype="float32")
    trees = EngineDecoder(target, tok, draft=folders["dspark"], dtype="float32", lookup_first=1, tree_width=2,
                          schedule="fixed")  # whole trees verified (auto may cut an untrained draft's)
    assert trees.proposer.tree and trees.proposer.draft.tree_width == 2
    for messages in MESSAGES:
        prompt = render_prompt(tok, messages)
        want = plain.generate(prompt, max_new_tokens=16, sampling=SamplingParams())
        got = trees.generate(prompt, max_new_tokens=16, sampling=SamplingParams())
        assert got.output_ids == want.output_ids
        assert got.num_draft_tokens > got.num_verify_steps  # several nodes verified per step
    sampled = trees.generate(prompt, max_new_tokens=8, sampling=SamplingParams(temperature=1.0), seed=0)
    assert 1 <= len(sampled.output_ids) <= 8 and sampled.num_draft_tokens > sampled.num_verify_steps
    with pytest.raises(ValueError, match="serve.tree_width: set with no draft"):
        EngineDecoder(target, tok, tree_width=1)


def test_serve_with_a_missing_draft_fails_before_loading_the_target(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the error")

    monkeypatch.setattr(load, "load_target", refuse)
    assert main(["serve", "--port", "0", "--draft", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no draft found" in err and "Traceback" not in err
    assert main(["serve", "--port", "0", "--num-draft-tokens", "2"]) == 2
    assert "no --draft" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--lookup-first", "2"]) == 2
    assert "serve.lookup_first: set with no draft" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--tree-width", "1"]) == 2
    assert "serve.tree_width: set with no draft" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--draft", str(tmp_path), "--lookup-corpus", str(tmp_path / "p.jsonl")]) == 2
    assert "serve.lookup_corpus: nothing reads it" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--max-queued-requests", "0"]) == 2
    assert "serve.max_queued_requests=0: expected an integer >= 1" in capsys.readouterr().err
