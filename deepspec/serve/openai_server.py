"""A small OpenAI-compatible HTTP server over the target (``deepspec serve``), speculative with ``--draft``.

``deepspec serve`` decodes every request through the speculative engine
(:class:`deepspec.serve.decoder.EngineDecoder`): with ``--draft`` (a ``deepspec train`` run) the
draft proposes and the target verifies, losslessly; without it the same engine decodes target-only.
The server object without a decoder answers through the local backend (Hugging Face ``generate``);
the tests of :class:`deepspec.data.backends.OpenAIBackend` use it that way, with fault injection.
Production serving uses vLLM or SGLang (``deepspec export``). The HTTP stack is theirs: a Starlette
application served by uvicorn. Endpoints:

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
  reads is checked (:func:`deepspec.serve.requests.request_messages`,
  :func:`deepspec.serve.requests.request_generation`): a bad value, ``n > 1``, or a feature this
  server does not implement (stop strings, logprobs, tools, ``logit_bias``, ...) is refused with 400
  in OpenAI's error format, whose ``param`` names the field, never answered as if absent; fields it
  does not know are ignored, as vLLM does. A ``model`` other than ``model_name`` is refused with 404
  ``"The model `X` does not exist."``, as vLLM does (a missing ``model`` is refused with 400); a
  prompt that does not fit the target's positions is refused with 400.
- With a decoder: ``stream: true`` answers as server-sent events in OpenAI's chunk format (a role
  chunk, content chunks as the engine commits tokens, a last chunk with ``finish_reason``, a usage
  chunk when ``stream_options.include_usage``, then ``data: [DONE]``); and every answer carries the
  request's acceptance figures under ``deepspec``: ``draft``, ``num_speculative_tokens`` (the most
  tokens proposed per step), ``lookup_first`` and ``num_lookup_tokens`` (prompt lookup in front of the
  draft: the shortest match that proposes and the most tokens it proposes; None when off),
  ``num_verify_steps``, ``num_draft_tokens`` (proposed), ``num_accepted_tokens``, ``num_committed_tokens``,
  ``tau`` (mean over verify steps of the tokens committed: accepted + 1, or accepted at an accepted EOS) and
  ``tok_per_s`` (in the last chunk when streamed). Without one,
  streaming is refused (400).

Requests are checked on the event loop as they arrive, then decoded one at a time in arrival order
(the model is not thread-safe): they wait in a bounded FIFO queue (:class:`EngineQueue`) whose one
worker thread runs the generations off the event loop. When ``max_queued_requests`` requests already
wait, one more is answered 503 with ``Retry-After`` (seconds) and an OpenAI error (``type``
``"server_overloaded"``). A client that closes its connection leaves the queue at once, or stops its
request at the next decoding step (with a decoder), so an abandoned request does not hold the queue.
An exception while decoding is answered 500 (an error event and ``[DONE]`` once a stream has begun).
Test-only fault injection is set through the constructor, never through the environment:
``fail_first`` answers the first k chat requests with HTTP 500, ``delay_s`` adds a random delay
(seeded), ``hold`` (a ``threading.Event``) holds chat requests after ``hold_after`` of them until the
event is set (before they queue), and ``token_ids=False`` never returns generated ids (a server that
returns only text).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from deepspec.algorithms.ngram.corpus import DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus, check_corpus_use
from deepspec.algorithms.ngram.proposer import check_lookup_settings
from deepspec.algorithms.protocol import check_tree_setting
from deepspec.checkpoints import draft_folder
from deepspec.data.backends import GenerationParams, LocalBackend
from deepspec.data.chat import render_prompt
from deepspec.decoding.settings import SCHEDULES
from deepspec.device import check_device_name, check_dtype_name, resolve_device
from deepspec.eval.run import answer_text
from deepspec.serve.decoder import EngineDecoder
from deepspec.serve.engine_queue import EngineQueue, QueueFull
from deepspec.serve.requests import (RequestError, invalid_request, openai_error, request_generation,
                                     request_messages, usage)
from deepspec.target import load  # called as load.load_target, where tests stub it
from deepspec.target.few_row_linear import check_few_row_mode

DEFAULT_MAX_QUEUED_REQUESTS = 64
# seconds a stopping server gives answers in flight before it cancels them (their decoding stops at the next step)
SHUTDOWN_GRACE_S = 2


class OpenAICompatServer:
    """The server object: it listens from construction on; :meth:`start` serves in a daemon thread,
    :meth:`serve_forever` in this one (Ctrl-C stops it), :meth:`stop` stops a started one.

    Args:
        model, tokenizer: the target (the local backend answers with them when ``decoder`` is None).
        host, port: the address to listen on (port 0: any free port; :attr:`port` tells which).
        model_name: the one model ``GET /v1/models`` lists and requests must name.
        decoder: the engine that answers (streaming and acceptance figures need it); None = the local
            backend (Hugging Face ``generate``).
        max_queued_requests: requests that may wait for the engine behind the one it decodes (>= 1);
            one more is answered 503 with ``Retry-After``.
        fail_first, delay_s, delay_seed, hold, hold_after, token_ids: test-only fault injection (module
            docstring).

    Raises:
        OSError: ``host:port`` cannot be listened on.
        ValueError: ``max_queued_requests`` is not an integer >= 1.

    Attributes:
        received: every chat-completions request body (parsed JSON), in arrival order.
        prompts: the rendered prompt ids of each answered request (what the template produced).
        num_failed_injected: requests answered with an injected 500.
        num_abandoned: requests whose client went away before their answer (dropped from the queue, or
            stopped at the next decoding step).
        num_refused_full: requests answered 503 because the queue was full.
    """

    def __init__(self, model: Any, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "deepspec-target", fail_first: int = 0,
                 delay_s: tuple[float, float] = (0.0, 0.0), delay_seed: int = 0,
                 hold: threading.Event | None = None, hold_after: int = 0, token_ids: bool = True,
                 decoder: EngineDecoder | None = None,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        self.backend = LocalBackend(model, tokenizer, batch_size=1)
        self.decoder = decoder
        self.token_ids = token_ids
        self.model_name = model_name
        self.fail_first, self.delay_s, self.hold, self.hold_after = fail_first, delay_s, hold, hold_after
        self._rng = random.Random(delay_seed)
        self.num_chat_requests = 0
        self.num_failed_injected = 0
        self.num_abandoned = 0
        self.num_refused_full = 0
        self.received: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []
        self.queue = EngineQueue(max_queued_requests)
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        routes = [Route(path + slash, endpoint, methods=[method])
                  for path, endpoint, method in (("/v1/models", self._models, "GET"),
                                                 ("/v1/chat/completions", self._chat_endpoint, "POST"))
                  for slash in ("", "/")]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, lifespan="off", log_config=None, log_level="warning",
                                                     access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    @property
    def base_url(self) -> str:
        host = self.socket.getsockname()[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    def start(self, timeout_s: float = 60.0) -> "OpenAICompatServer":
        """Serve in a daemon thread; returns once the server accepts requests.

        Raises RuntimeError when it has not started within ``timeout_s`` seconds or its thread ended."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"openai-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"serve: the HTTP server on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`stop` (or Ctrl-C in the main thread: uvicorn stops the server,
        then raises KeyboardInterrupt); closes the socket and the queue when it returns."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self.queue.close()

    def stop(self) -> None:
        """Stop a server :meth:`start` started: answers in flight get ``SHUTDOWN_GRACE_S`` seconds."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=SHUTDOWN_GRACE_S + 10)
        self.socket.close()
        self.queue.close()

    # ----------------------------------------------------------------------------------- handling
    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "deepspec"}]})

    async def _chat_endpoint(self, request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _json(*invalid_request("body: expected a JSON object"))
        answer = await self._chat(body)
        if isinstance(answer, tuple):
            return _json(*answer)
        return await answer.admit(request.receive)

    async def _chat(self, body: dict[str, Any]) -> "tuple[int, dict[str, Any]] | _QueuedAnswer":
        """Check one chat-completions request: ``(status, payload)`` when it is refused, else the
        :class:`_QueuedAnswer` that queues its job and sends the answer."""
        self.num_chat_requests += 1
        number = self.num_chat_requests
        self.received.append(body)
        delay = self._rng.uniform(*self.delay_s) if self.delay_s[1] > 0 else 0.0
        if self.hold is not None and number > self.hold_after:
            while not self.hold.is_set():  # polled: the event loop goes on serving
                await asyncio.sleep(0.01)
        if delay:
            await asyncio.sleep(delay)
        if number <= self.fail_first:
            self.num_failed_injected += 1
            return 500, {"error": {"message": f"injected failure {number}/{self.fail_first}", "type": "server_error"}}
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return invalid_request("model: expected the served model name (see GET /v1/models)", "model")
        if model != self.model_name:  # vLLM's message and status
            return openai_error(404, f"The model `{model}` does not exist.", param="model", type_="NotFoundError",
                                code=404)
        stream = body.get("stream")
        if stream not in (None, False, True):
            return invalid_request(f"stream={stream!r}: expected true or false", "stream")
        if stream and self.decoder is None:
            return invalid_request("stream is supported by `deepspec serve` (the engine's decoder) only", "stream")
        try:
            messages = request_messages(body)
            generation, stop_ids = request_generation(body, vocab_size=int(self.backend.model.config.vocab_size))
        except RequestError as exc:
            return invalid_request(str(exc), exc.param)
        if self.decoder is not None:
            return self._engine_chat(body, number, messages, generation, stop_ids, bool(stream))

        def local(client: _Client) -> tuple[int, dict[str, Any]]:
            try:
                result, prompt = self.backend.answer_one(messages, generation, body.get("chat_template_kwargs"),
                                                         extra_stop_token_ids=stop_ids)
            except Exception as exc:  # template errors etc. are the client's problem: 400 with the reason
                return invalid_request(f"{type(exc).__name__}: {exc}")
            self.prompts.append(prompt)
            return 200, self._completion(body, number, prompt, result.text, result.token_ids or [], result.cut)

        return _QueuedAnswer(self, local, stream=False)

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
            "model": self.model_name, "choices": [choice], "usage": usage(prompt, token_ids),
        }

    def _engine_chat(self, body: dict[str, Any], number: int, messages: list, generation: GenerationParams,
                     stop_ids: list[int], stream: bool) -> "tuple[int, dict[str, Any]] | _QueuedAnswer":
        """A request decoded by :attr:`decoder` (speculatively with a draft): ``(status, payload)`` when the
        prompt is refused, else its queued answer. Its job (run on the engine's thread) returns ``(status,
        payload)``, or streams its events to the client and returns None. Both carry the request's
        acceptance figures under ``deepspec`` (:class:`ServeResult`). A client that goes away stops the
        decoding at the next step (:class:`_ClientGone`; nothing is sent)."""
        tokenizer = self.backend.tokenizer
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            return invalid_request(f"chat_template_kwargs={kwargs!r:.80}: expected an object", "chat_template_kwargs")
        try:
            prompt = render_prompt(tokenizer, messages, chat_template_kwargs=kwargs)
        except Exception as exc:  # template errors are the client's problem: 400 with the reason
            return invalid_request(f"messages: the chat template refused the conversation ({type(exc).__name__}: "
                                   f"{exc})", "messages")
        limit = int(self.decoder.target_model.config.max_position_embeddings)
        if len(prompt) >= limit:
            return invalid_request(f"the prompt has {len(prompt)} tokens; the target's context holds {limit} "
                                   "positions: shorten the conversation", "messages")
        stop_set = self.decoder.stop_token_ids_for(stop_ids)

        def decode(client: _Client, on_tokens):
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

        def answer(client: _Client) -> tuple[int, dict[str, Any]]:
            result = decode(client, lambda new: None)
            cut = result.finish_reason == "length"
            text = answer_text(tokenizer, result.output_ids, stop_set)
            payload = self._completion(body, number, prompt, text, result.output_ids, cut)
            payload["deepspec"] = acceptance(result)
            return 200, payload

        if not stream:
            return _QueuedAnswer(self, answer, stream=False)

        options = body.get("stream_options") or {}
        head = {"id": f"chatcmpl-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                         **extra}]}

        def streamed(client: _Client) -> None:
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

            client.send(chunk({"role": "assistant", "content": ""}))
            result = decode(client, on_tokens)
            send_text(final=True)
            cut = result.finish_reason == "length"
            extra = {"stop_reason": self._stop_reason(result.output_ids, cut)}
            if body.get("return_token_ids") and self.token_ids:
                extra["token_ids"] = result.output_ids
            last = chunk({}, result.finish_reason, **extra)
            last["deepspec"] = acceptance(result)
            client.send(last)
            if options.get("include_usage"):
                client.send({**head, "choices": [], "usage": usage(prompt, result.output_ids)})
            client.done()

        return _QueuedAnswer(self, streamed, stream=True)


def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(payload, status_code=status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's routing errors (no such route: 404; a route without this method: 405) in OpenAI's format."""
    assert isinstance(exc, HTTPException)
    message = f"no route {request.url.path}" if exc.status_code == 404 else \
        f"{request.method} {request.url.path}: {exc.detail}"
    return _json(exc.status_code, {"error": {"message": message, "type": "not_found" if exc.status_code == 404
                                             else "invalid_request_error", "param": None, "code": exc.status_code}},
                 headers=exc.headers)


class _ClientGone(Exception):
    """The client closed its connection while its request was decoded."""


_DONE = b"data: [DONE]\n\n"
_END = object()  # the job has finished: its future is settled


class _Client:
    """What a job on the engine's thread sees of its request: :meth:`gone` tells whether the client
    closed its connection (or the server is stopping); :meth:`send` and :meth:`done` hand server-sent
    events (OpenAI's streaming format: ``data: <json>`` lines, then ``data: [DONE]``) to the event loop,
    which writes them. :meth:`send` raises :class:`_ClientGone` once the client is gone."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self._loop, self._events = loop, events
        self.left = threading.Event()

    def gone(self) -> bool:
        return self.left.is_set()

    def put(self, item: Any) -> None:
        """Hand ``item`` to the event loop (from any thread); nothing when the loop has closed."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the server stopped: nobody reads the events
            pass

    def send(self, event: dict[str, Any]) -> None:
        if self.gone():
            raise _ClientGone
        self.put(b"data: " + json.dumps(event).encode("utf-8") + b"\n\n")

    def done(self) -> None:
        self.put(_DONE)


class _Nothing:
    """No answer: the client has gone."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pass


class _QueuedAnswer:
    """The answer of one admitted request, an ASGI response: :meth:`admit` queues its job (or refuses it
    with 503 when the queue is full); called, it sends the job's answer (JSON, or the events of a stream
    as the job produces them), or nothing when the client went away.

    ``job(client)`` runs on the engine's thread and returns ``(status, payload)``, or (streamed) sends
    its events through ``client`` and returns None."""

    def __init__(self, server: OpenAICompatServer, job: Callable[["_Client"], Any], *, stream: bool) -> None:
        self.server, self.job, self.stream = server, job, stream

    async def admit(self, receive: Receive) -> "_QueuedAnswer | JSONResponse | _Nothing":
        """Watch for the client leaving (``receive`` yields ``http.disconnect``) and queue the job: this
        answer, the 503 when the queue is full, or nothing when the client has left already."""
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.client = _Client(loop, self.events)
        self.future: Future | None = None
        self.watcher = loop.create_task(self._watch(receive))
        await asyncio.sleep(0)  # the watcher reads once: a client that left while its request was held is seen now
        if self.client.gone():
            self.server.num_abandoned += 1
            return _Nothing()
        queue = self.server.queue
        try:
            self.future = queue.submit(lambda: self.job(self.client))
        except (QueueFull, RuntimeError) as exc:
            self.watcher.cancel()
            retry_after = exc.retry_after_s if isinstance(exc, QueueFull) else SHUTDOWN_GRACE_S
            if isinstance(exc, QueueFull):
                self.server.num_refused_full += 1
                message = (f"the server is busy: {exc.num_waiting} requests wait for the engine (its queue holds "
                           f"{queue.max_queued}, --max-queued-requests); retry after {retry_after} s")
            else:
                message = f"the server is stopping; retry after {retry_after} s (on another server)"
            return _json(*openai_error(503, message, type_="server_overloaded", code=503),
                         headers={"Retry-After": str(retry_after)})
        self.future.add_done_callback(lambda _: self.client.put(_END))
        return self

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client.left.set()  # the job stops at its next decoding step ...
        if self.future is not None:
            self.future.cancel()  # ... or leaves the queue now if it has not started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        try:
            while (item := await self.events.get()) is not _END:
                if not self.stream or self.client.gone():
                    continue
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
                await send({"type": "http.response.body", "body": item, "more_body": True})
        except asyncio.CancelledError:  # the server is stopping: the job stops at its next step
            self.client.left.set()
            if self.future is not None:
                self.future.cancel()
            raise
        finally:
            self.watcher.cancel()
        future = self.future
        assert future is not None
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or isinstance(error, _ClientGone) or self.client.gone():
            self.server.num_abandoned += 1
            return
        if error is not None:
            traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
            status, payload = openai_error(500, f"decoding failed: {type(error).__name__}: {error}",
                                           type_="server_error", code=500)
            if not started:
                await _json(status, payload)(scope, receive, send)
                return
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(payload).encode("utf-8")
                        + b"\n\n" + _DONE, "more_body": True})
        if self.stream:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await _json(*future.result())(scope, receive, send)
@dataclass(kw_only=True)
class ServeConfig:
    """``deepspec serve``: an OpenAI-compatible server over the target (for tests and CPU use)."""

    target: str = "default"  # "default" (the embedded SmolLM2), a Hugging Face model folder or a GGUF file
    # a Jinja chat template file replacing the target's, or a built-in name (gemma3);
    # GGUF files often carry none (docs/guide/targets.md, "Chat templates")
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
    # auto: per step a cost-aware scheduler verifies the part of the draft's proposal worth its cost, or makes a
    # plain target step (deepspec.decoding.schedule; lossless); fixed: every proposal is verified whole
    schedule: str = "auto"
    # verify forwards compute each row bit for bit as a one-token forward would (deepspec.target.exact_rows):
    # greedy answers equal target-only's in bfloat16 too, at a cost per verify step
    exact: bool = False
    # requests that may wait for the engine behind the one it decodes (served in arrival order); one more is
    # answered 503 with Retry-After
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"ServeConfig.port={self.port!r}: expected an integer in [0, 65535] (0 = any free port).")
        if not self.host:
            raise ValueError("ServeConfig.host: expected a host name or address, e.g. 127.0.0.1.")
        self.dtype = check_dtype_name(self.dtype, "serve.dtype")
        self.device = check_device_name(self.device, "serve.device")
        self.few_row_linear = check_few_row_mode(self.few_row_linear, "serve.few_row_linear")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"serve.schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"serve.num_draft_tokens: expected an integer >= 1 or none (the draft's K), "
                             f"got {self.num_draft_tokens}")
        if self.num_draft_tokens is not None and not self.draft:
            raise ValueError("serve.num_draft_tokens: set with no --draft; give the draft to speculate with, or drop it")
        check_lookup_settings(self.lookup_first, self.lookup_num_tokens, has_draft=bool(self.draft), field="serve")
        check_corpus_use(self.lookup_corpus, self.corpus_ngram_min, lookup_first=self.lookup_first, baselines=None,
                         field="serve")
        check_tree_setting(self.tree_width, "serve.tree_width", has_draft=bool(self.draft))
        if isinstance(self.max_queued_requests, bool) or not isinstance(self.max_queued_requests, int) \
                or self.max_queued_requests < 1:
            raise ValueError(f"serve.max_queued_requests={self.max_queued_requests!r}: expected an integer >= 1 "
                             "(requests that may wait for the engine; more are answered 503)")


def _port_unavailable(host: str, port: int, exc: OSError) -> ValueError:
    return ValueError(f"serve: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port "
                      "(0 = any free port), stop what uses it, or give another --host.")


def check_listenable(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it, so that a taken port fails before the target loads.

    Raises ValueError naming the address and the fix when the bind fails (port in use, no such
    address, a privileged port)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as socket.create_server binds
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
                            schedule=cfg.schedule, exact=cfg.exact, cast_in_place=loaded_here)
    try:
        server = OpenAICompatServer(decoder.target_model, tokenizer, host=cfg.host, port=cfg.port,
                                    model_name=cfg.model_name or cfg.target, decoder=decoder,
                                    max_queued_requests=cfg.max_queued_requests)
    except OSError as exc:  # taken between the check and now
        raise _port_unavailable(cfg.host, cfg.port, exc) from None
    mode = (f"speculative, draft {decoder.draft_name}"
            f"{f' behind prompt lookup (matches of {cfg.lookup_first}+ tokens propose up to {decoder.num_lookup_tokens})' if cfg.lookup_first else ''}"
            f"{f' and a corpus of {corpus.num_tokens:,} answer tokens' if corpus is not None else ''}"
            f"{f', draft trees (--tree-width {cfg.tree_width})' if cfg.tree_width else ''}, "
            f"up to {decoder.num_draft_tokens} tokens per step" if decoder.draft_name else "target-only")
    print(f"serve: {server.model_name!r} at {server.base_url} (POST /chat/completions, GET /models; {mode}; "
          f"{str(decoder.dtype).removeprefix('torch.')} on {decoder.device}; up to {cfg.max_queued_requests} "
          "requests queued); Ctrl-C stops", flush=True)
    server.serve_forever()
