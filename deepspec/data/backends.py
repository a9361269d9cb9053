"""Regeneration backends: produce the target's answer to the next assistant turn of many conversations.

docs/design/data.md, "Regeneration". The prepare stage (:mod:`deepspec.data.prepare`) hands a backend a list of
:class:`TurnRequest` (the history so far, ending on a user turn, plus per-request sampling
parameters and chat-template kwargs) and receives one :class:`TurnResult` per request through a
callback, in *completion* order; the caller restores input order. Two backends:

- :class:`LocalBackend`: the target in-process, batched ``model.generate`` with left padding
  (exact in fp32: batched output equals one-at-a-time output).
- :class:`OpenAIBackend`: OpenAI-compatible servers (vLLM, SGLang, ``deepspec serve``) through the
  ``openai`` package: several base URLs, a concurrency cap per server, bounded retries with
  exponential backoff on connection errors, timeouts, 429 and 5xx.

Both return the answer *text* as the target wrote it (not stripped), the generated token ids when
known (the local backend always; servers that return them: vLLM's ``token_ids`` with
``return_token_ids``, or logprobs tokens in vLLM's ``token_id:N`` form), the number of generated
tokens (including the stop token when one was produced) and ``cut``: True when the answer hit
``max_new_tokens`` (OpenAI ``finish_reason == "length"``) so its end-of-turn token was never generated.

Decoding is pinned (:mod:`deepspec.target.decoding`): every setting is explicit, locally and in
every server request, so the checkpoint's ``generation_config.json`` never changes the answers; both
stop on the one stop rule (:func:`deepspec.data.chat.stop_token_ids`), sent to servers as
``stop_token_ids``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deepspec.data.chat import render_prompt, target_stop_token_ids
from deepspec.target.decoding import SamplingParams, openai_request_fields, pinned_generate
from deepspec.target.few_row_linear import few_row_linear, few_row_linear_applies


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """Per-request generation: ``sampling`` (the one :class:`~deepspec.target.decoding.SamplingParams`
    rule: ``temperature == 0`` is greedy; nothing else changes the logits), at most ``max_new_tokens``
    new tokens, and the ``seed`` of a sampled request (unused when greedy)."""

    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class TurnRequest:
    """One assistant turn to generate.

    ``key`` names the row in error messages (e.g. ``"in.jsonl[17] (id abc) turn 0"``); ``messages``
    is the conversation so far and must end on a user (or system) turn.
    """

    key: str
    messages: list[dict[str, str]]
    generation: GenerationParams
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class TurnResult:
    """The answer text (unstripped), the generated ids, their count, and whether ``max_new_tokens`` cut it.

    ``token_ids``: the ids the target generated, ending with the stop token it produced unless
    ``cut``; None when the server returned none (the text is then all there is). ``refused`` is
    non-empty (the server's reason) when a server rejected this request as invalid (HTTP 400/422,
    e.g. a prompt longer than its context): a problem of the row, not of the server.
    """

    text: str
    num_tokens: int
    cut: bool
    token_ids: list[int] | None = None
    refused: str = ""


OnResult = Callable[[int, TurnResult], None]


class RegenerationBackend(Protocol):
    """What the prepare stage needs from a backend."""

    name: str

    def generate(self, requests: Sequence[TurnRequest], on_result: OnResult) -> None:
        """Answer every request; call ``on_result(i, result)`` once per request ``i``, in any order.

        Raises an exception (after bounded retries, for remote backends) when a request cannot be
        answered; results already delivered through ``on_result`` stay valid.
        """
        ...

    def close(self) -> None:
        """Release resources (idempotent)."""
        ...


# --------------------------------------------------------------------------------------------- local


def _left_pad(batch_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns (input_ids_BT long, attention_mask_BT long)."""
    width = max(len(ids) for ids in batch_ids)
    input_ids_BT = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(batch_ids), width), dtype=torch.long)
    for b, ids in enumerate(batch_ids):
        input_ids_BT[b, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask_BT[b, width - len(ids):] = 1
    return input_ids_BT, attention_mask_BT


def generate_batch(model: Any, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                   temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[tuple[list[int], bool]]:
    """Generate one answer per prompt (left padded, one pinned ``model.generate`` call).

    Decoding is :func:`deepspec.target.decoding.pinned_generate`: greedy, or temperature + top-k +
    top-p, nothing read from the checkpoint's generation config. Returns per prompt ``(generated
    ids, cut)``: the ids up to and including the first stop token (``eos_ids``, the stop rule), or
    all ``max_new_tokens`` of them with ``cut`` True when none appeared. Sampling
    (``temperature > 0``) uses the global torch RNG (seed it before the call).
    """
    input_ids_BT, attention_mask_BT = _left_pad(prompts, pad_id)
    device = next(model.parameters()).device
    out_BT = pinned_generate(model, input_ids_BT.to(device), attention_mask_BT.to(device),
                             max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             stop_token_ids=eos_ids, pad_token_id=pad_id)
    new_BN = out_BT[:, input_ids_BT.shape[1]:].cpu().tolist()
    eos = set(eos_ids)
    results = []
    for row in new_BN:
        stop = next((k for k, t in enumerate(row) if t in eos), None)
        results.append((row[:max_new_tokens], True) if stop is None else (row[:stop + 1], False))
    return results


# Batched generation multiplies every weight matrix by one row per request at each decoding step. On
# a CPU without native bf16 (AVX2, float32), batches of up to 32 rows generate faster with the few-row
# path (deepspec.target.few_row_linear) than with ``F.linear``, with identical ids (`python
# bench/prepare.py --rounds 3`, docs/results/prepare-cpu-2026-12-01/); at 64 rows the two kernels cost
# the same per product, so larger batches keep ``F.linear``.
BATCH_FEW_ROW_MAX_ROWS = 32


class LocalBackend:
    """The target in-process: requests sharing sampling settings are sorted by prompt length inside
    windows of ``sort_window`` requests (None: all) and generated ``batch_size`` at a time.

    ``few_row_linear`` (``auto`` | ``on`` | ``off``): decoding steps of batches of at most
    :data:`BATCH_FEW_ROW_MAX_ROWS` rows compute the target's linear layers as ``(W @ x^T)^T``
    (:mod:`deepspec.target.few_row_linear`; ``auto``: float32 on the CPU). The sums run in another
    order, so an id can differ from ``F.linear``'s where two logits tie to the last bits; the ids
    recorded are the ones generated either way.

    Prompts are rendered with :func:`deepspec.data.chat.render_prompt` (the one prompt rule shared
    with training and evaluation), passing each request's ``chat_template_kwargs``. Generation stops
    on ``stop_token_ids`` (default: :func:`deepspec.data.chat.target_stop_token_ids`, the one stop
    rule). Sampling seeds: each batch seeds the global torch RNG with its first request's seed, so
    sampled answers depend on the batch composition (greedy answers do not).
    """

    name = "local"

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 32, sort_window: int | None = None,
                 stop_token_ids: list[int] | None = None, few_row_linear: str = "auto") -> None:
        if batch_size <= 0:
            raise ValueError(f"LocalBackend.batch_size={batch_size}: expected a positive integer.")
        self.model, self.tokenizer = model, tokenizer
        self.few_row_rows = (min(batch_size, BATCH_FEW_ROW_MAX_ROWS)
                             if batch_size > 1 and few_row_linear_applies(few_row_linear, model) else 0)
        self.batch_size, self.sort_window = batch_size, sort_window
        self.eos_ids = sorted(stop_token_ids) if stop_token_ids else target_stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def answer_one(self, messages: Sequence[Mapping[str, str]], generation: GenerationParams,
                   chat_template_kwargs: Mapping[str, Any] | None = None,
                   extra_stop_token_ids: Sequence[int] = ()) -> tuple[TurnResult, list[int]]:
        """Answer a single conversation; returns ``(result, prompt_ids)`` (used by ``deepspec serve``).
        ``extra_stop_token_ids`` stop generation too (a request's ``stop_token_ids``, as in vLLM)."""
        prompt = render_prompt(self.tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
        stop = sorted(set(self.eos_ids) | {int(t) for t in extra_stop_token_ids})
        return self._generate([prompt], generation, stop)[0], prompt

    def _generate(self, prompts: list[list[int]], generation: GenerationParams,
                  stop_ids: list[int] | None = None) -> list[TurnResult]:
        s = generation.sampling
        if not s.greedy and generation.seed is not None:
            torch.manual_seed(generation.seed)
        stop_ids = stop_ids or self.eos_ids
        with (few_row_linear(self.model, max_rows=self.few_row_rows) if self.few_row_rows > 1
              else contextlib.nullcontext()):
            answers = generate_batch(self.model, prompts, pad_id=self.pad_id, eos_ids=stop_ids,
                                     max_new_tokens=generation.max_new_tokens, temperature=s.temperature,
                                     top_k=s.top_k, top_p=s.top_p)
        return [TurnResult(text=self.tokenizer.decode(ids if cut else ids[:-1], skip_special_tokens=True),
                           num_tokens=len(ids), cut=cut, token_ids=list(ids)) for ids, cut in answers]

    def generate(self, requests: Sequence[TurnRequest], on_result: OnResult) -> None:
        """See :class:`RegenerationBackend`. Template errors (``ValueError``/jinja ``TemplateError``)
        propagate; the caller renders prompts first so that they are caught per row."""
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        for i, req in enumerate(requests):
            prompt = render_prompt(self.tokenizer, req.messages, chat_template_kwargs=req.chat_template_kwargs)
            group_key = (req.generation.max_new_tokens, req.generation.sampling,
                         tuple(sorted((req.chat_template_kwargs or {}).items())))
            groups.setdefault(group_key, []).append((i, prompt))
        for jobs in groups.values():
            windows = [jobs] if self.sort_window is None else [
                jobs[k:k + self.sort_window] for k in range(0, len(jobs), self.sort_window)]
            for window in windows:
                window = sorted(window, key=lambda job: len(job[1]))
                for b in range(0, len(window), self.batch_size):
                    batch = window[b:b + self.batch_size]
                    results = self._generate([p for _, p in batch], requests[batch[0][0]].generation)
                    for (i, _), result in zip(batch, results):
                        on_result(i, result)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- OpenAI


class BackendError(RuntimeError):
    """A request could not be answered (after retries); the message names the row and the server."""


@dataclass
class _Server:
    base_url: str
    client: Any = None
    num_requests: int = 0
    num_retries: int = 0
    busy_s: float = field(default=0.0)


class OpenAIBackend:
    """OpenAI-compatible chat-completions servers (vLLM, SGLang, ``deepspec serve``).

    Args:
        base_urls: one or more server URLs ending in ``/v1`` (e.g. ``http://host:8000/v1``).
        model: the served model name; None asks each server's ``GET /v1/models`` and uses the single
            model listed (a ValueError if a server lists none or several, or servers disagree).
        api_key: sent as the bearer token (vLLM ignores it unless started with ``--api-key``).
        max_concurrency: requests in flight per server (one worker coroutine each; work is spread
            by availability, so a faster server takes more requests).
        max_retries: retries per request on connection errors, timeouts, HTTP 429 and 5xx, with
            exponential backoff ``retry_backoff_s * 2**attempt`` (jittered, capped at 60 s); then
            :class:`BackendError` naming the row and the server. Other HTTP errors (400, 401, 404,
            ...) are not retried.
        request_timeout_s: per-request timeout.
        stop_token_ids: the stop rule's ids (:func:`deepspec.data.chat.stop_token_ids`), sent as
            ``stop_token_ids`` so the server stops where the local backend and evaluation do.
        eos_token_id: the tokenizer's eos id: the stop token of an answer a server ended on EOS
            without listing it among the returned ids (vLLM: ``finish_reason`` "stop",
            ``stop_reason`` null).

    Each request pins decoding (:func:`deepspec.target.decoding.openai_request_fields`):
    ``messages``, ``max_tokens``, ``temperature``, ``top_p``, ``presence_penalty`` 0,
    ``frequency_penalty`` 0, ``seed`` (sampling only) and, in ``extra_body`` (the vLLM/SGLang
    extensions), ``top_k`` (-1 = off), ``min_p`` 0, ``repetition_penalty`` 1, ``stop_token_ids``,
    ``return_token_ids`` (vLLM: the generated ids come back in ``choices[0].token_ids``) and, when
    set, ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}`` for Qwen3). The answer text is
    ``choices[0].message.content``; a response carrying the reasoning separately
    (``reasoning_content``: a server started with a reasoning parser) is refused, since the think
    block would be lost from the training data. Generated ids are read from ``choices[0].token_ids``,
    else from ``logprobs`` tokens written ``token_id:N`` (vLLM's ``--return-tokens-as-token-ids``);
    the stop token is appended when a server leaves it out (``stop_reason`` when it is a token id,
    else ``eos_token_id``); ids that cannot be completed that way (a stop string) are dropped and the
    turn is text only.
    """

    name = "openai"

    def __init__(self, base_urls: Sequence[str], *, model: str | None = None, api_key: str = "EMPTY",
                 max_concurrency: int = 8, max_retries: int = 5, request_timeout_s: float = 600.0,
                 retry_backoff_s: float = 1.0, log: Callable[[str], None] = print,
                 stop_token_ids: Sequence[int] = (), eos_token_id: int | None = None) -> None:
        if not base_urls:
            raise ValueError("OpenAIBackend.base_urls: expected at least one server URL (e.g. http://host:8000/v1).")
        if max_concurrency <= 0 or max_retries < 0 or request_timeout_s <= 0 or retry_backoff_s < 0:
            raise ValueError(f"OpenAIBackend: expected max_concurrency > 0, max_retries >= 0, request_timeout_s > 0, "
                             f"retry_backoff_s >= 0; got {max_concurrency}, {max_retries}, {request_timeout_s}, "
                             f"{retry_backoff_s}.")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.model = model
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.log = log
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.eos_token_id = eos_token_id
        self.num_retries = 0  # over the backend's lifetime, for the summary

    # The async client is bound to an event loop, so each generate() call builds its own clients.
    def _clients(self) -> list[_Server]:
        from openai import AsyncOpenAI

        return [_Server(url, AsyncOpenAI(base_url=url, api_key=self.api_key, max_retries=0,
                                         timeout=self.request_timeout_s)) for url in self.base_urls]

    async def _resolve_model(self, servers: list[_Server]) -> str:
        names: dict[str, list[str]] = {}
        for s in servers:
            listed = await self._with_retries(lambda s=s: s.client.models.list(), s, f"GET {s.base_url}/models")
            ids = sorted(m.id for m in listed.data)
            if len(ids) != 1:
                raise ValueError(f"{s.base_url}/models lists {len(ids)} models ({ids[:8]}); pass --server-model "
                                 f"(server_model) naming the one to use.")
            names.setdefault(ids[0], []).append(s.base_url)
        if len(names) != 1:
            raise ValueError(f"the servers serve different models ({names}); every base URL must serve the same "
                             f"target, or pass --server-model (server_model).")
        return next(iter(names))

    def resolve_model(self) -> str:
        """The served model name (from the config or ``/v1/models``). Raises ValueError, BackendError."""
        if self.model is None:
            async def main() -> str:
                servers = self._clients()
                try:
                    return await self._resolve_model(servers)
                finally:
                    for s in servers:
                        await s.client.close()
            self.model = asyncio.run(main())
        return self.model

    @staticmethod
    def _retryable(exc: BaseException) -> bool:
        import openai

        if isinstance(exc, (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)):
            return True  # APITimeoutError is an APIConnectionError
        return isinstance(exc, openai.APIStatusError) and (exc.status_code >= 500 or exc.status_code in (408, 429))

    @staticmethod
    def _not_found_hint(exc: BaseException, server: _Server) -> str:
        """A hint for HTTP 404: a base URL missing its ``/v1``, or a model name the server does not serve."""
        import openai

        if not isinstance(exc, openai.NotFoundError):
            return ""
        hints = []
        if not server.base_url.endswith("/v1"):
            hints.append(f"OpenAI-compatible base URLs usually end in /v1 (e.g. http://host:8000/v1); got "
                         f"{server.base_url}")
        text = str(exc).lower()
        if "model" in text and ("does not exist" in text or "not found" in text):
            hints.append(f"check --server-model against the names listed by GET {server.base_url}/models")
        return "".join(f". Hint: {h}" for h in hints)

    async def _with_retries(self, call: Callable[[], Any], server: _Server, what: str) -> Any:
        import openai

        for attempt in range(self.max_retries + 1):
            try:
                return await call()
            except openai.OpenAIError as exc:
                if not self._retryable(exc):
                    raise BackendError(f"{what}: server {server.base_url} refused the request: {exc}"
                                       f"{self._not_found_hint(exc, server)}") from exc
                if attempt == self.max_retries:
                    raise BackendError(f"{what}: server {server.base_url} still failing after {self.max_retries} "
                                       f"retries ({type(exc).__name__}: {exc}). Completed rows are kept in the "
                                       f"journal; fix or drop the server and run the same command again.") from exc
                delay = min(60.0, self.retry_backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                server.num_retries += 1
                self.num_retries += 1
                self.log(f"openai backend: {what}: {type(exc).__name__} from {server.base_url}; retry "
                         f"{attempt + 1}/{self.max_retries} in {delay:.1f} s")
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def request_kwargs(self, req: TurnRequest) -> dict[str, Any]:
        """The ``chat.completions.create`` arguments of one request (decoding pinned, see the class doc)."""
        g, s = req.generation, req.generation.sampling
        fields, extra = openai_request_fields(max_new_tokens=g.max_new_tokens, temperature=s.temperature,
                                              top_k=s.top_k, top_p=s.top_p,
                                              seed=g.seed if not s.greedy else None,
                                              stop_token_ids=self.stop_token_ids)
        extra["return_token_ids"] = True
        if not self.stop_token_ids:
            extra.pop("stop_token_ids")
        if req.chat_template_kwargs:
            extra["chat_template_kwargs"] = dict(req.chat_template_kwargs)
        return dict(model=self.model, messages=[dict(m) for m in req.messages], n=1, **fields, extra_body=extra)

    def _token_ids(self, choice: Any, cut: bool) -> list[int] | None:
        """The generated ids of a choice (stop token last unless cut), or None when the server gave none."""
        extra = getattr(choice, "model_extra", None) or {}
        ids = extra.get("token_ids")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            content = getattr(getattr(choice, "logprobs", None), "content", None) or []
            tokens = [getattr(c, "token", "") for c in content]
            if not tokens or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                return None
            try:
                ids = [int(t.removeprefix("token_id:")) for t in tokens]
            except ValueError:
                return None
        ids = [int(t) for t in ids]
        if cut or (ids and ids[-1] in self.stop_token_ids):
            return ids
        reason = extra.get("stop_reason")
        if isinstance(reason, int) and not isinstance(reason, bool):
            return ids + [reason]
        if reason is None and self.eos_token_id is not None:
            return ids + [int(self.eos_token_id)]
        return None  # stopped by a stop string: no stop token to supervise, the text is all there is

    async def _answer(self, server: _Server, req: TurnRequest) -> TurnResult:
        kwargs = self.request_kwargs(req)
        try:
            response = await self._with_retries(lambda: server.client.chat.completions.create(**kwargs), server,
                                                req.key)
        except BackendError as exc:
            import openai

            cause = exc.__cause__
            if isinstance(cause, openai.APIStatusError) and cause.status_code in (400, 422):
                return TurnResult(text="", num_tokens=0, cut=False, refused=f"HTTP {cause.status_code} from "
                                  f"{server.base_url}: {cause.message}")
            raise
        if not response.choices:
            raise BackendError(f"{req.key}: server {server.base_url} returned no choices.")
        choice = response.choices[0]
        message = choice.message
        extra = getattr(message, "model_extra", None) or {}
        if extra.get("reasoning_content") or extra.get("reasoning"):
            raise BackendError(
                f"{req.key}: server {server.base_url} returned the reasoning separately (reasoning_content); start "
                f"the server without a reasoning parser so the answer text keeps its think block.")
        if choice.finish_reason not in ("stop", "length", "eos", None):
            raise BackendError(f"{req.key}: server {server.base_url} finished with {choice.finish_reason!r}; "
                               f"expected 'stop' or 'length'.")
        usage = getattr(response, "usage", None)
        cut = choice.finish_reason == "length"
        return TurnResult(text=message.content or "", num_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                          cut=cut, token_ids=self._token_ids(choice, cut))

    async def _run(self, requests: Sequence[TurnRequest], on_result: OnResult) -> None:
        servers = self._clients()
        try:
            if self.model is None:
                self.model = await self._resolve_model(servers)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(requests)):
                queue.put_nowait(i)

            async def worker(server: _Server) -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    t0 = time.perf_counter()
                    result = await self._answer(server, requests[i])
                    server.busy_s += time.perf_counter() - t0
                    server.num_requests += 1
                    on_result(i, result)

            tasks = [asyncio.create_task(worker(s)) for s in servers for _ in range(self.max_concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for s in servers:
                await s.client.close()

    def generate(self, requests: Sequence[TurnRequest], on_result: OnResult) -> None:
        """See :class:`RegenerationBackend`. Raises :class:`BackendError` (row and server named) or
        ValueError (model resolution); ``on_result`` runs in the event-loop thread."""
        if requests:
            asyncio.run(self._run(requests, on_result))

    def close(self) -> None:
        pass
