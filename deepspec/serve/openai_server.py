"""A small OpenAI-compatible HTTP server over the target (``deepspec serve``), speculative with ``--draft``.

``deepspec serve`` decodes every request through the speculative engine
(:class:`deepspec.serve.decoder.EngineDecoder`): with ``--draft`` (a ``deepspec train`` run) the
draft proposes and the target verifies, losslessly; without it the same engine decodes target-only.
The server object without a decoder answers through the local backend (Hugging Face ``generate``);
the tests of :class:`deepspec.data.backends.OpenAIBackend` use it that way, with fault injection.
Production serving uses vLLM or SGLang (``deepspec export``). Endpoints:

- ``GET /v1/models``: one model, named by ``model_name``.
- ``POST /v1/chat/completions``: ``messages``, ``max_tokens`` (or ``max_completion_tokens``),
  ``temperature``, ``top_p``, ``top_k`` (0 or -1 = off), ``seed``, ``stop_token_ids`` (added to the
  stop rule, as in vLLM), ``chat_template_kwargs`` (as vLLM/SGLang: passed to the chat template) and
  ``return_token_ids`` (as vLLM: the generated ids, stop token included, in
  ``choices[0].token_ids``). Decoding is pinned as everywhere in DeepSpec
  (:mod:`deepspec.target.decoding`): the target's generation config is never read; ``min_p``,
  ``repetition_penalty``, ``presence_penalty`` and ``frequency_penalty`` are accepted at their
  neutral values (0, 1, 0, 0) and refused (400) otherwise, never ignored. Generation stops on the
  one stop rule (:func:`deepspec.data.chat.target_stop_token_ids`). Answers with ``finish_reason``
  ``"length"`` when ``max_tokens`` cut the answer, else ``"stop"`` (``stop_reason``: the stop
  token id, null for the tokenizer's eos, as vLLM), and ``usage.completion_tokens``. Every field it
  reads is checked (:func:`request_messages`, :func:`request_generation`): a bad value, ``n > 1``,
  or a feature this server does not implement (stop strings, logprobs, tools, ``logit_bias``, ...)
  is refused with 400 in OpenAI's error format, whose ``param`` names the field, never answered as
  if absent; fields it does not know are ignored, as vLLM does.
  A ``model`` other than ``model_name`` is refused with 404 ``"The model `X` does not exist."``, as
  vLLM does (a missing ``model`` is refused with 400); a prompt that does not fit the target's
  positions is refused with 400.
- With a decoder: ``stream: true`` answers as server-sent events in OpenAI's chunk format (a role
  chunk, content chunks as the engine commits tokens, a last chunk with ``finish_reason``, a usage
  chunk when ``stream_options.include_usage``, then ``data: [DONE]``); and every answer carries the
  request's acceptance figures under ``deepspec``: ``draft``, ``num_speculative_tokens`` (the most
  tokens proposed per step), ``lookup_first`` and ``num_lookup_tokens`` (prompt lookup in front of the
  draft: the shortest match that proposes and the most tokens it proposes; None when off),
  ``num_verify_steps``, ``num_draft_tokens`` (proposed), ``num_accepted_tokens``, ``tau`` (mean over
  verify steps of accepted + 1) and ``tok_per_s`` (in the last chunk when streamed). Without one,
  streaming is refused (400).

Requests are served one at a time through the model (a lock; ``ThreadingHTTPServer`` accepts
connections concurrently). With a decoder, a client that closes its connection stops its request at
the next decoding step, so an abandoned request does not hold the queue. Test-only fault injection
is set through the constructor, never through the environment: ``fail_first`` answers the first
k chat requests with HTTP 500, ``delay_s`` adds a random delay (seeded), ``hold`` (a
``threading.Event``) blocks chat requests after ``hold_after`` of them until the event is set, and
``token_ids=False`` never returns generated ids (a server that returns only text).
"""

from __future__ import annotations

import json
import math
import random
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from deepspec.algorithms.ngram.corpus import DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus, check_corpus_use
from deepspec.algorithms.ngram.proposer import check_lookup_settings
from deepspec.algorithms.protocol import check_tree_setting
from deepspec.checkpoints import draft_folder
from deepspec.data.backends import GenerationParams, LocalBackend
from deepspec.data.chat import render_prompt
from deepspec.device import check_device_name, check_dtype_name, resolve_device
from deepspec.eval.run import answer_text
from deepspec.serve.decoder import EngineDecoder
from deepspec.target import load  # called as load.load_target, where tests stub it
from deepspec.target.decoding import NEUTRAL_SETTINGS, SamplingParams
from deepspec.target.few_row_linear import check_few_row_mode


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # client went away: fine
            super().handle_error(request, client_address)


class OpenAICompatServer:
    """The server object; :meth:`start` runs it in a daemon thread, :meth:`serve_forever` in this one.

    Attributes:
        received: every chat-completions request body (parsed JSON), in arrival order.
        prompts: the rendered prompt ids of each answered request (what the template produced).
        num_failed_injected: requests answered with an injected 500.
    """

    def __init__(self, model: Any, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "deepspec-target", fail_first: int = 0,
                 delay_s: tuple[float, float] = (0.0, 0.0), delay_seed: int = 0,
                 hold: threading.Event | None = None, hold_after: int = 0, token_ids: bool = True,
                 decoder: EngineDecoder | None = None) -> None:
        self.backend = LocalBackend(model, tokenizer, batch_size=1)
        self.decoder = decoder
        self.token_ids = token_ids
        self.model_name = model_name
        self.fail_first, self.delay_s, self.hold, self.hold_after = fail_first, delay_s, hold, hold_after
        self._rng = random.Random(delay_seed)
        self._lock = threading.Lock()  # one generation at a time; also guards the counters
        self._count_lock = threading.Lock()
        self.num_chat_requests = 0
        self.num_failed_injected = 0
        self.num_abandoned = 0  # requests whose client went away while they were decoded
        self.received: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []
        self.httpd = _QuietHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.httpd.server_address[0]}:{self.port}/v1"

    def start(self) -> "OpenAICompatServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"openai-server-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ----------------------------------------------------------------------------------- handling
    def _chat(self, body: dict[str, Any], client: "_Client") -> tuple[int, dict[str, Any]] | None:
        """Answer one chat-completions request: ``(status, payload)``, or None when the answer was streamed
        to ``client`` (a request with ``stream: true`` served by :attr:`decoder`) or the client went away
        while it was decoded (the decoding stops at the next step)."""
        with self._count_lock:
            self.num_chat_requests += 1
            number = self.num_chat_requests
            self.received.append(body)
            delay = self._rng.uniform(*self.delay_s) if self.delay_s[1] > 0 else 0.0
        if self.hold is not None and number > self.hold_after:
            self.hold.wait()
        if delay:
            time.sleep(delay)
        if number <= self.fail_first:
            with self._count_lock:
                self.num_failed_injected += 1
            return 500, {"error": {"message": f"injected failure {number}/{self.fail_first}", "type": "server_error"}}
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _invalid("model: expected the served model name (see GET /v1/models)", "model")
        if model != self.model_name:  # vLLM's message and status
            return _error(404, f"The model `{model}` does not exist.", param="model", type_="NotFoundError",
                          code=404)
        stream = body.get("stream")
        if stream not in (None, False, True):
            return _invalid(f"stream={stream!r}: expected true or false", "stream")
        if stream and self.decoder is None:
            return _invalid("stream is supported by `deepspec serve` (the engine's decoder) only", "stream")
        try:
            messages = request_messages(body)
            generation, stop_ids = request_generation(body, vocab_size=int(self.backend.model.config.vocab_size))
        except RequestError as exc:
            return _invalid(str(exc), exc.param)
        if self.decoder is not None:
            return self._engine_chat(body, number, messages, generation, stop_ids, client, bool(stream))
        try:
            with self._lock:
                result, prompt = self.backend.answer_one(messages, generation, body.get("chat_template_kwargs"),
                                                         extra_stop_token_ids=stop_ids)
                self.prompts.append(prompt)
        except Exception as exc:  # template errors etc. are the client's problem: 400 with the reason
            return _invalid(f"{type(exc).__name__}: {exc}")
        return 200, self._completion(body, number, prompt, result.text, result.token_ids or [], result.cut)

    def _stop_reason(self, token_ids: list[int], cut: bool) -> int | None:
        """vLLM's ``stop_reason``: the stop token id, None for the tokenizer's eos or a cut answer."""
        if not cut and token_ids and token_ids[-1] != self.backend.tokenizer.eos_token_id:
            return token_ids[-1]
        return None

    def _completion(self, body: dict[str, Any], number: int, prompt: list[int], text: str, token_ids: list[int],
                    cut: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "length" if cut else "stop", "logprobs": None,
                                  "stop_reason": self._stop_reason(token_ids, cut)}
        if body.get("return_token_ids") and self.token_ids:
            choice["token_ids"] = token_ids
        return {
            "id": f"chatcmpl-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice], "usage": _usage(prompt, token_ids),
        }

    def _engine_chat(self, body: dict[str, Any], number: int, messages: list, generation: GenerationParams,
                     stop_ids: list[int], client: "_Client", stream: bool) -> tuple[int, dict[str, Any]] | None:
        """A request decoded by :attr:`decoder` (speculatively with a draft). Non-streamed: ``(status,
        payload)``; streamed: the events are written to ``client`` and None returned. Both carry the
        request's acceptance figures under ``deepspec`` (:class:`ServeResult`). A client that goes away
        stops the decoding at the next step (None; nothing is sent)."""
        tokenizer = self.backend.tokenizer
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            return _invalid(f"chat_template_kwargs={kwargs!r:.80}: expected an object", "chat_template_kwargs")
        try:
            prompt = render_prompt(tokenizer, messages, chat_template_kwargs=kwargs)
        except Exception as exc:  # template errors are the client's problem: 400 with the reason
            return _invalid(f"messages: the chat template refused the conversation ({type(exc).__name__}: {exc})",
                            "messages")
        limit = int(self.decoder.target_model.config.max_position_embeddings)
        if len(prompt) >= limit:
            return _invalid(f"the prompt has {len(prompt)} tokens; the target's context holds {limit} positions: "
                            "shorten the conversation", "messages")
        stop_set = self.decoder.stop_token_ids_for(stop_ids)

        def decode(on_tokens):
            def checked(new: list[int]) -> None:
                if client.gone():
                    raise _ClientGone
                on_tokens(new)
            try:
                return self.decoder.generate(prompt, max_new_tokens=generation.max_new_tokens,
                                             sampling=generation.sampling, seed=generation.seed,
                                             extra_stop_token_ids=stop_ids, on_tokens=checked)
            finally:
                self.prompts.append(prompt)

        def acceptance(result) -> dict[str, Any]:
            return {"draft": self.decoder.draft_name, "num_speculative_tokens": self.decoder.num_draft_tokens,
                    "lookup_first": self.decoder.lookup_first, "num_lookup_tokens": self.decoder.num_lookup_tokens,
                    **result.acceptance()}

        if not stream:
            with self._lock:
                try:
                    result = decode(lambda new: None)
                except _ClientGone:
                    self.num_abandoned += 1
                    return None
            cut = result.finish_reason == "length"
            text = answer_text(tokenizer, result.output_ids, stop_set)
            payload = self._completion(body, number, prompt, text, result.output_ids, cut)
            payload["deepspec"] = acceptance(result)
            return 200, payload

        options = body.get("stream_options") or {}
        head = {"id": f"chatcmpl-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                         **extra}]}

        ids: list[int] = []
        sent = ""

        def send_text(final: bool) -> None:
            # the text of the ids so far, less what was sent; held back while it ends in an incomplete
            # character (a byte-level token can split one), or if decoding more ids rewrote earlier text
            nonlocal sent
            text = answer_text(tokenizer, ids, stop_set)  # as the local backend: the stop token is not text
            if text.startswith(sent) and len(text) > len(sent) and (final or not text.endswith("\ufffd")):
                client.send(chunk({"content": text[len(sent):]}))
                sent = text

        def on_tokens(new: list[int]) -> None:
            ids.extend(new)
            send_text(final=False)

        with self._lock:
            try:
                client.start()
                client.send(chunk({"role": "assistant", "content": ""}))
                result = decode(on_tokens)
            except _ClientGone:
                self.num_abandoned += 1
                return None
            send_text(final=True)
            cut = result.finish_reason == "length"
            extra = {"stop_reason": self._stop_reason(result.output_ids, cut)}
            if body.get("return_token_ids") and self.token_ids:
                extra["token_ids"] = result.output_ids
            last = chunk({}, result.finish_reason, **extra)
            last["deepspec"] = acceptance(result)
            client.send(last)
            if options.get("include_usage"):
                client.send({**head, "choices": [], "usage": _usage(prompt, result.output_ids)})
            client.done()
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: tests and batch jobs
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "created": 0, "owned_by": "deepspec"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self.close_connection = True
                    self._send(*_invalid("Content-Length: expected a number of bytes >= 0"))
                    return
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    return
                try:
                    body = json.loads(raw)
                    assert isinstance(body, dict)
                except (ValueError, AssertionError):
                    self._send(*_invalid("body: expected a JSON object"))
                    return
                answer = server._chat(body, _Client(self))
                if answer is None:  # streamed, or the client went away
                    self.close_connection = True
                else:
                    self._send(*answer)

        return Handler


class _ClientGone(Exception):
    """The client closed its connection while its request was decoded."""


class _Client:
    """The connection of one request: :meth:`gone` tells whether the client closed it; :meth:`start`,
    :meth:`send` and :meth:`done` write server-sent events (OpenAI's streaming format: ``data: <json>``
    lines, then ``data: [DONE]``; the connection closes after it, no Content-Length). A write to a
    closed connection raises :class:`_ClientGone`."""

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self.handler = handler

    def gone(self) -> bool:
        """True when the peer has closed the connection (readable, and a peek reads end of file). A client
        waiting for its answer sends nothing, so readable bytes mean a close (or a pipelined request)."""
        sock = self.handler.connection
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _write(self, data: bytes) -> None:
        try:
            self.handler.wfile.write(data)
            self.handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _ClientGone from exc

    def start(self) -> None:
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

    def send(self, event: dict[str, Any]) -> None:
        self._write(b"data: " + json.dumps(event).encode("utf-8") + b"\n\n")

    def done(self) -> None:
        self._write(b"data: [DONE]\n\n")


class RequestError(ValueError):
    """A request this server refuses with 400; ``param`` names the offending field (OpenAI's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, *, param: str | None = None, type_: str = "invalid_request_error",
           code: Any = None) -> tuple[int, dict[str, Any]]:
    """An error answer in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _invalid(message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """A 400 answer in OpenAI's error format."""
    return _error(400, message, param=param)


def _usage(prompt: list[int], token_ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(token_ids),
            "total_tokens": len(prompt) + len(token_ids)}


_INT64 = (-(2 ** 63), 2 ** 63 - 1)  # the range of a request seed, as vLLM's schema
# OpenAI request features this server does not implement, with the value that means "not used": a request
# that uses one is refused (400), never answered as if the field were absent.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "stop": ((None, "", []), "stop strings are not supported; send stop_token_ids (token ids) instead"),
    "logprobs": ((None, False), "logprobs are not returned; send return_token_ids for the generated ids"),
    "top_logprobs": ((None, 0), "logprobs are not returned"),
    "logit_bias": ((None, {}), "logit_bias would change the target's distribution; decoding is pinned"),
    "tools": ((None, []), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "response_format": ((None, {"type": "text"}), "structured output is not supported"),
    "best_of": ((None, 1), "best_of > 1 is not supported (one choice per request)"),
    "use_beam_search": ((None, False), "beam search is not supported"),
}


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None,
             hint: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(name, f"{name}={value!r}: expected an integer {bound}{hint}")
    return value


def _number(body: dict[str, Any], name: str, default: float, ok: Any, expected: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise RequestError(name, f"{name}={value!r}: expected {expected}")
    return float(value)


def request_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The request's ``messages`` as ``[{"role", "content"}]`` with string contents: a content given as
    OpenAI content parts keeps its text parts, joined by newlines (as vLLM). Raises :class:`RequestError`
    naming the message (``messages[i].role`` / ``.content``) and what to send instead."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages: expected a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("messages", f"messages[{i}]: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise RequestError("messages", f"messages[{i}].role={role!r}: expected system, user or assistant")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            if not all(isinstance(t, str) for t in parts):
                raise RequestError("messages", f"messages[{i}].content: only text parts "
                                               "({\"type\": \"text\", \"text\": ...}) are supported")
            content = "\n".join(parts)
        if not isinstance(content, str):
            raise RequestError("messages", f"messages[{i}].content: expected a string or a list of text parts, "
                                           f"received {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def request_generation(body: dict[str, Any], *, vocab_size: int) -> tuple[GenerationParams, list[int]]:
    """The pinned generation settings of a chat-completions request and its extra stop ids.

    Fields: ``max_tokens`` (or ``max_completion_tokens``; an integer >= 1, default 256), ``temperature``
    (>= 0, default 0 = greedy), ``top_p`` (in (0, 1], default 1), ``top_k`` (an integer; 0 or -1 = off),
    ``seed`` (an int64), ``stop_token_ids`` (ids in ``[0, vocab_size)``), ``n`` (1). Penalties and
    ``min_p`` are accepted at their neutral values only (decoding is pinned, :mod:`deepspec.target.decoding`);
    the features in ``_UNSUPPORTED`` (stop strings, logprobs, tools, ...) are refused when used.

    Raises:
        RequestError: (a 400) naming the field, the value received and what is accepted.
    """
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        neutral = NEUTRAL_SETTINGS[name]
        if _number(body, name, neutral, lambda v: True, "a number") != float(neutral):
            raise RequestError(name, f"{name}={body[name]!r}: deepspec serve decodes with {name}={neutral} only "
                                     f"(pinned decoding); drop the field or send {neutral}")
    for name, (unused, reason) in _UNSUPPORTED.items():
        if body.get(name) not in unused:
            raise RequestError(name, f"{name}={body[name]!r:.80}: {reason}")
    _integer(body, "n", 1, 1, 1, " (one choice per request: n > 1 is not supported)")
    max_tokens = _integer(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 256, 1)
    top_k = _integer(body, "top_k", 0, -1, hint=" (0 or -1 = off)")
    seed = _integer(body, "seed", None, *_INT64)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids):
        raise RequestError("stop_token_ids", f"stop_token_ids={stop_ids!r:.80}: expected a list of token ids "
                                             f"in [0, {vocab_size})")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0.0, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
        top_k=max(top_k, 0),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)"))
    return GenerationParams(max_new_tokens=max_tokens, sampling=sampling, seed=seed), stop_ids


@dataclass(kw_only=True)
class ServeConfig:
    """``deepspec serve``: an OpenAI-compatible server over the target (for tests and CPU use)."""

    target: str = "default"  # "default" (the embedded SmolLM2), a Hugging Face model folder or a GGUF file
    # a Jinja chat template file replacing the target's, or a built-in name (gemma3);
    # GGUF files often carry none (README, "--target takes")
    chat_template: str | None = None
    host: str = "127.0.0.1"  # interface to listen on (0.0.0.0: every interface)
    port: int = 8000  # TCP port
    model_name: str = ""  # served model name; "" = the target spec
    # speculative decoding: a trained draft (a `deepspec train` run folder, a checkpoint or a draft folder);
    # "" = target-only decoding through the same engine
    draft: str = ""
    num_draft_tokens: int | None = None  # tokens proposed per step at most (vLLM's num_speculative_tokens); none = K
    # prompt lookup in front of the draft (deepspec.algorithms.ngram.LookupFirstProposer): an n-gram match of at
    # least this many tokens proposes, else the draft; none = off (2 is a good start)
    lookup_first: int | None = None
    lookup_num_tokens: int | None = None  # the most tokens a lookup match proposes; none = the draft's K
    # prepare-stage outputs (JSONL with generated_ids) whose target answers the lookup also searches where the
    # context has no match (deepspec.algorithms.ngram.corpus); needs lookup_first
    lookup_corpus: list[str] = field(default_factory=list)
    corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN  # the shortest context suffix looked up in the corpus
    # requests verify draft trees in one target forward (docs/design/decoding.md, "Draft trees"): 0 = chains; 1 = the
    # lookup's match beside the draft's chain; W >= 2 = also W draft nodes per slot
    tree_width: int = 0
    # target and draft dtype: auto (bfloat16 on CUDA or a CPU with AVX512-BF16/AMX, else float32) | float32 | bfloat16
    dtype: str = "auto"
    # where target and draft decode: auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda | cuda:N
    device: str = "auto"
    few_row_linear: str = "auto"  # verify forwards' few-row linear path (deepspec.target.few_row_linear): auto | on | off
    allow_target_mismatch: bool = False  # serve a draft whose recorded target fingerprint differs (same shape)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"ServeConfig.port={self.port!r}: expected an integer in [0, 65535] (0 = any free port).")
        if not self.host:
            raise ValueError("ServeConfig.host: expected a host name or address, e.g. 127.0.0.1.")
        self.dtype = check_dtype_name(self.dtype, "serve.dtype")
        self.device = check_device_name(self.device, "serve.device")
        self.few_row_linear = check_few_row_mode(self.few_row_linear, "serve.few_row_linear")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"serve.num_draft_tokens: expected an integer >= 1 or none (the draft's K), "
                             f"got {self.num_draft_tokens}")
        if self.num_draft_tokens is not None and not self.draft:
            raise ValueError("serve.num_draft_tokens: set with no --draft; give the draft to speculate with, or drop it")
        check_lookup_settings(self.lookup_first, self.lookup_num_tokens, has_draft=bool(self.draft), field="serve")
        check_corpus_use(self.lookup_corpus, self.corpus_ngram_min, lookup_first=self.lookup_first, baselines=None,
                         field="serve")
        check_tree_setting(self.tree_width, "serve.tree_width", has_draft=bool(self.draft))


def _port_unavailable(host: str, port: int, exc: OSError) -> ValueError:
    return ValueError(f"serve: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port "
                      "(0 = any free port), stop what uses it, or give another --host.")


def check_listenable(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it, so that a taken port fails before the target loads.

    Raises ValueError naming the address and the fix when the bind fails (port in use, no such
    address, a privileged port)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
            probe.bind((host, port))
    except OSError as exc:
        raise _port_unavailable(host, port, exc) from None


def run_serve_stage(cfg: ServeConfig, *, target_model: Any = None, tokenizer: Any = None) -> None:
    """Load the target and serve it until interrupted (Ctrl-C).

    Raises ValueError when ``cfg.host:cfg.port`` cannot be listened on (checked before the target
    loads, and again when the server binds) or ``cfg.device`` is not there (checked before the target
    loads), and what target loading raises."""
    check_listenable(cfg.host, cfg.port)
    resolve_device(cfg.device, "serve.device")  # a device that is not there fails before the target loads
    if cfg.draft:
        draft_folder(cfg.draft)  # a wrong --draft fails before the target loads
    corpus = (NGramCorpus.from_prepared(cfg.lookup_corpus, field="serve.lookup_corpus")  # so does a bad corpus
              if cfg.lookup_corpus else None)
    loaded_here = target_model is None or tokenizer is None
    if loaded_here:
        target_model, tokenizer = load.load_target(cfg.target, chat_template=cfg.chat_template)
    load.require_chat_template(tokenizer, cfg.target)
    decoder = EngineDecoder(target_model, tokenizer, draft=cfg.draft or None, num_draft_tokens=cfg.num_draft_tokens,
                            dtype=cfg.dtype, device=cfg.device, few_row_linear=cfg.few_row_linear,
                            allow_target_mismatch=cfg.allow_target_mismatch, lookup_first=cfg.lookup_first,
                            lookup_num_tokens=cfg.lookup_num_tokens, corpus=corpus,
                            corpus_ngram_min=cfg.corpus_ngram_min, tree_width=cfg.tree_width,
                            cast_in_place=loaded_here)
    try:
        server = OpenAICompatServer(decoder.target_model, tokenizer, host=cfg.host, port=cfg.port,
                                    model_name=cfg.model_name or cfg.target, decoder=decoder)
    except OSError as exc:  # taken between the check and now
        raise _port_unavailable(cfg.host, cfg.port, exc) from None
    mode = (f"speculative, draft {decoder.draft_name}"
            f"{f' behind prompt lookup (matches of {cfg.lookup_first}+ tokens propose up to {decoder.num_lookup_tokens})' if cfg.lookup_first else ''}"
            f"{f' and a corpus of {corpus.num_tokens:,} answer tokens' if corpus is not None else ''}"
            f"{f', draft trees (--tree-width {cfg.tree_width})' if cfg.tree_width else ''}, "
            f"up to {decoder.num_draft_tokens} tokens per step" if decoder.draft_name else "target-only")
    print(f"serve: {server.model_name!r} at {server.base_url} (POST /chat/completions, GET /models; {mode}; "
          f"{str(decoder.dtype).removeprefix('torch.')} on {decoder.device}); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        server.httpd.server_close()
