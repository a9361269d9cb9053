"""The fields of an OpenAI chat-completions request that ``deepspec serve`` reads, checked, and its error format.

Every field the server reads is checked here: a bad value, ``n > 1`` or a feature the server does not
implement (stop strings, logprobs, tools, ``logit_bias``, ...) raises :class:`RequestError`, answered
with 400 in OpenAI's error format (:func:`openai_error`) whose ``param`` names the field; fields it does
not know are ignored, as vLLM does. Decoding is pinned (:mod:`deepspec.target.decoding`).
"""

from __future__ import annotations

import math
from typing import Any

from deepspec.data.backends import GenerationParams
from deepspec.target.decoding import NEUTRAL_SETTINGS, SamplingParams


class RequestError(ValueError):
    """A request this server refuses with 400; ``param`` names the offending field (OpenAI's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def openai_error(status: int, message: str, *, param: str | None = None, type_: str = "invalid_request_error",
                 code: Any = None) -> tuple[int, dict[str, Any]]:
    """``(status, payload)``: an error answer in OpenAI's format, ``{"error": {"message", "type", "param",
    "code"}}``; ``param`` names the request field at fault (None when no one field is)."""
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """A 400 answer in OpenAI's error format."""
    return openai_error(400, message, param=param)


def usage(prompt: list[int], token_ids: list[int]) -> dict[str, int]:
    """OpenAI's ``usage``: prompt, completion (generated ids, stop token included) and total token counts."""
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
