"""Chat rendering through the tokenizer's own template, with the training loss mask.

Rule (docs/design/data.md, "Chat templates and loss masks"):
the loss mask is 1 exactly on the tokens the target *generates* in an
assistant turn: the assistant content and its end-of-turn token. It is 0 on system and user turns,
on the assistant header (the generation prompt supplies it), and on template text written after the
end-of-turn token (ChatML writes ``<|im_end|>\\n``; the model stops at ``<|im_end|>``, the ``\\n`` is
template glue and is never generated).

How the mask is found (no template-specific parsing): for each assistant turn ``i`` the template
renders ``prompt_i = messages[:i]`` *with* the generation prompt (:func:`render_prompt`, the exact
ids the target was given when it generated turn ``i``) and ``upto_i = messages[:i+1]`` without it.
``prompt_i`` must be an exact token prefix of ``upto_i`` (otherwise training and inference would see
different prompts: "template drift", a ValueError, e.g. leading whitespace in the content). The new
tokens ``upto_i[len(prompt_i):]`` are what the target generated; the mask covers them up to and
including the last end-of-turn token among them.

Templates that rewrite history (Qwen3): the real Qwen3 template drops the think block of assistant
turns that precede the last user query, and with ``enable_thinking=False`` its generation prompt
writes an empty ``<think>\\n\\n</think>\\n\\n``. So ``upto_i`` is not always a prefix of the full
render. Rule (:func:`render_training_samples`): every assistant turn is supervised exactly once, in a
token sequence identical to the one the target generated it in (``prompt_i`` followed by its answer):

* a turn whose ``upto_i`` is a prefix of the full render is supervised in the full-conversation
  sample (suffix ``""``);
* a turn the template rewrites once later turns follow gets its own sample ``upto_i`` ending at that
  turn (suffix ``"/turn<i>"``), and is masked 0 wherever it appears rewritten (in the full sample and
  in samples of later turns).

Templates without rewriting (ChatML SmolLM2, Llama 3) give exactly one sample.

Think rule (one rule shared with evaluation, which renders prompts with the same
:func:`render_prompt` and the same ``chat_template_kwargs``):

* ``enable_thinking=False``: the empty ``<think>\\n\\n</think>\\n\\n`` is written by the generation
  prompt, so it belongs to the prompt and is never supervised; the answer and ``<|im_end|>`` are.
* thinking on (the default): the generation prompt ends at ``<|im_start|>assistant\\n``; the whole
  generated ``<think>\\nR\\n</think>\\n\\nA<|im_end|>`` (reasoning, ``</think>``, answer, end-of-turn)
  is supervised, the header is not. (If the stored answer has no think block, the template still
  writes an empty one for the final turn; the target would generate it too, so it is supervised.)

Edge cases: an empty assistant turn is supervised on its end-of-turn token alone (the target produced
nothing but end-of-turn; for Qwen3 with thinking on also the empty think block the template writes).
Messages after the last assistant turn (a conversation ending on a user turn) are not part of any
training sample: nothing after them is supervised, so they are dropped before rendering.

Tokens are always produced by ``apply_chat_template(tokenize=True)``: special tokens written by the
template are never added a second time (exactly one BOS, checked). The same function,
:func:`render_prompt`, builds prompts for regeneration (prepare), training and evaluation.

Stop tokens (one rule, :func:`stop_token_ids`, used by prepare, the cache's loss mask, online mode,
evaluation and ``deepspec serve``): the target's ``generation_config.eos_token_id`` (int or list),
the tokenizer's ``eos_token_id``, and the special token(s) the chat template writes right after an
assistant message's content (:func:`template_end_of_turn_ids`: a one-turn conversation is rendered
with a sentinel answer and the special tokens that follow it are taken). No list of token names:
a name such as ``</s>`` is an ordinary token in some vocabularies (Qwen3: id 128247).

Supervising the generated ids (``generated_ids``): when the ids the target generated for an
assistant turn are known (prepare keeps them), that turn is supervised on exactly those ids after
exactly the prompt the target was given (``render_prompt(messages[:i])``, the history as text, as
prepare fed it). If the template's render of the stored text gives the same ids (the usual case:
the answer survives the text round trip), nothing changes. If it does not (trailing whitespace the
template trims, ``"\\n\\n"`` re-split, a stop token other than the template's end-of-turn, an answer
cut inside a multi-byte character, a whitespace-only answer that drifts into the header), the turn
gets its own sample ``prompt_i + generated_ids_i`` (all of the ids supervised) and is masked 0 where
its text appears in later turns' prompts (there it is history, exactly as the target saw it). Such a
last turn makes the full sample itself ``prompt + generated_ids``. Turns with only text keep the
render rule above; their supervised span is compared with the text's own tokenisation and a
difference is counted (``counts``), never silently repaired.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepspec.utils import token_id_list

# The assistant content rendered to find the template's end-of-turn token(s): no whitespace, so no
# template trims or re-splits it.
_SENTINEL = "DeepSpecAnswerSentinel"


def _template_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (no extra special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat_template; DeepSpec renders conversations only "
            f"through the tokenizer's own template. Use an instruct/chat tokenizer or set tokenizer.chat_template."
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"tokenize", "add_generation_prompt", "conversation", "messages"} & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs: keys {sorted(reserved)} are set by DeepSpec itself; remove them "
                         f"(pass only template variables such as enable_thinking).")
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs,
    )
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    ids = [int(t) for t in out]
    bos = getattr(tokenizer, "bos_token_id", None)
    if isinstance(bos, int) and ids[:2] == [bos, bos]:
        raise ValueError(
            f"the render starts with two BOS tokens ({tokenizer.decode([bos])!r}): the chat template writes "
            f"bos_token and something added it again. DeepSpec needs exactly one BOS."
        )
    return ids


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def template_end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token(s) the chat template writes right after an assistant message's content.

    Renders ``[user "Hi", assistant <sentinel>]`` (text, template defaults) and returns the leading
    run of special tokens that follows the sentinel: ChatML (SmolLM2, Qwen3) ``[<|im_end|>]`` (the
    ``\\n`` after it is ordinary text, not taken), Llama 3 ``[<|eot_id|>]``. Empty when the
    tokenizer has no chat template, the template refuses the probe, drops the sentinel, or writes
    no special token after it.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse any probe (jinja raise_exception); then no template ids
        return []
    pos = text.rfind(_SENTINEL) if isinstance(text, str) else -1
    if pos < 0:
        return []
    special = _special_ids(tokenizer)
    out: list[int] = []
    for t in tokenizer.encode(text[pos + len(_SENTINEL):], add_special_tokens=False):
        if int(t) not in special:
            break
        out.append(int(t))
    return out


def stop_token_ids(tokenizer: Any, *, generation_eos: int | Sequence[int] | None = None) -> list[int]:
    """The one stop rule: the token ids that end an assistant turn, sorted.

    Union of ``generation_eos`` (the target's ``generation_config.eos_token_id``: an int, a list,
    or None), the tokenizer's ``eos_token_id`` and :func:`template_end_of_turn_ids`. Used to stop
    generation (prepare, evaluation, ``deepspec serve``) and to find the end-of-turn token in the
    loss mask (cache, online mode). SmolLM2 -> ``[2]``; Qwen3 with its ``generation_config.json``
    (``[151645, 151643]``) -> ``[151643, 151645]``; Llama 3 with ``[128001, 128008, 128009]`` ->
    those three.

    Raises:
        ValueError: none of the three sources names a token.
    """
    ids = set(token_id_list(generation_eos)) | set(token_id_list(getattr(tokenizer, "eos_token_id", None)))
    ids |= set(template_end_of_turn_ids(tokenizer))
    if not ids:
        raise ValueError("stop_token_ids: neither the target's generation_config.eos_token_id, the tokenizer's "
                         "eos_token_id nor the chat template's end-of-turn token names a stop token; set "
                         "eos_token_id in the target's generation_config.json.")
    return sorted(ids)


def generation_eos_of(source: Any) -> int | list[int] | None:
    """The ``eos_token_id`` of a target's generation config: ``source`` is a loaded model (its
    ``generation_config``, falling back to its ``config``), a ``GenerationConfig``, a dict (a
    ``generation_config.json``) or None."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get("eos_token_id")
    if hasattr(source, "generation_config") or hasattr(source, "config"):
        eos = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
        return eos if eos is not None else getattr(getattr(source, "config", None), "eos_token_id", None)
    return getattr(source, "eos_token_id", None)


def target_stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """:func:`stop_token_ids` of a loaded target (its generation config's eos ids included)."""
    return stop_token_ids(tokenizer, generation_eos=generation_eos_of(model))


def _check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role={m['role']!r}: expected system, user or assistant "
                             f"(normalise sources with deepspec.data.conversations.normalise_messages).")


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]], *,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Prompt ids for generating the next assistant turn: ``messages`` + the generation prompt.

    The single prompt rule shared by regeneration (prepare), training (the prefix property of
    :func:`render_training_samples`) and evaluation (``deepspec.eval.run``).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` ending with a user (or system) message.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}`` for Qwen3
            (with it the generation prompt ends with the empty ``<think>\\n\\n</think>\\n\\n``).

    Returns:
        Token ids (``list[int]``), special tokens written once by the template.

    Raises:
        ValueError: empty ``messages``, the last message is an assistant turn, a malformed message,
            no chat template, a doubled BOS, or an empty render.
    """
    _check_messages(messages)
    if not messages:
        raise ValueError("messages is empty: a prompt needs at least one user message.")
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is an assistant turn: a prompt must end with a user (or system) "
                         "message; drop the final assistant turn to build the prompt that produced it.")
    ids = _template_ids(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
    if not ids:
        raise ValueError("the chat template renders this conversation as an empty prompt; the target needs at least "
                         "one token to answer. Fix the template (--chat-template) so that it writes the messages.")
    return ids


@dataclass(frozen=True)
class RenderedSample:
    """One training sample of a conversation: token ids, loss mask (equal length) and a name suffix
    (``""`` for the whole conversation; ``"/turn<i>"`` for a sample that ends at assistant turn ``i``,
    used when the template rewrites that turn once later turns follow). The sample id is
    ``row_id + suffix``."""

    input_ids: list[int]
    loss_mask: list[int]
    suffix: str = ""


@dataclass(frozen=True)
class _Turn:
    index: int  # message index of the assistant turn
    prompt: list[int]  # render_prompt(messages[:index]): what the target was given
    upto: list[int] | None  # render of messages[:index+1] without the generation prompt (None: it drifts)
    stop: int  # one past the last supervised position in ``upto`` (0 when ``upto`` is None)
    generated: list[int] | None  # the ids the target generated (None: text only)
    verbatim: bool  # the render's supervised span equals ``generated`` (always True for text-only turns)

    @property
    def start(self) -> int:
        """First supervised position (``len(prompt)``)."""
        return len(self.prompt)

    def own_sample(self) -> tuple[list[int], list[int]]:
        """This turn alone, as the target generated it: ``prompt + answer`` and its mask."""
        if self.verbatim:
            ids = list(self.upto)
            mask = [0] * len(ids)
            mask[self.start:self.stop] = [1] * (self.stop - self.start)
            return ids, mask
        return self.prompt + list(self.generated), [0] * len(self.prompt) + [1] * len(self.generated)


# Per-turn counts of render_training_samples: turns supervised on their generated ids, those whose render
# differs from the ids (supervised on the ids in a sample built from them), text-only turns, and text-only
# turns whose supervised content is not the tokenisation of their text.
COUNT_KEYS = ("num_turns_ids", "num_turns_ids_not_verbatim", "num_turns_text", "num_turns_text_retokenized")


def _diff_at(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_generated(generated_ids: Sequence[Any] | None, messages: Sequence[Mapping[str, str]]) -> list[Any]:
    if generated_ids is None:
        return [None] * len(messages)
    if not isinstance(generated_ids, Sequence) or isinstance(generated_ids, str) or \
            len(generated_ids) != len(messages):
        raise ValueError(f"generated_ids: expected a list with one entry per message ({len(messages)}: a list of "
                         f"token ids for a regenerated assistant turn, else null), received "
                         f"{generated_ids!r:.80}. Re-run `deepspec prepare`, or drop the field (text-only rows).")
    out = []
    for i, (ids, m) in enumerate(zip(generated_ids, messages)):
        if ids is None:
            out.append(None)
            continue
        if m["role"] != "assistant" or not isinstance(ids, Sequence) or \
                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"generated_ids[{i}]: expected null or (for an assistant turn) a list of token ids >= 0, "
                             f"received {ids!r:.80} for a {m['role']} turn.")
        out.append([int(t) for t in ids])
    return out


def _assistant_turns(tokenizer: Any, messages: Sequence[Mapping[str, str]], *, max_seq_len: int | None,
                     cut_turns: Collection[int], kwargs: Mapping[str, Any] | None, stop_ids: Collection[int] | None,
                     generated_ids: Sequence[Any] | None,
                     counts: dict[str, int] | None) -> tuple[list[int], list[_Turn]]:
    """Validate ``messages``; return (full render up to the last assistant turn, the assistant turns).

    Turns whose generation prompt is already ``>= max_seq_len`` tokens are left out (nothing of them
    survives truncation). A turn with generated ids whose render drifts or differs is not an error:
    it is marked not verbatim (supervised on its ids in a sample of its own).
    """
    _check_messages(messages)
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len={max_seq_len}: expected a positive integer or None.")
    assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_idx:
        raise ValueError("conversation has no assistant turn: nothing to supervise.")
    if assistant_idx[0] == 0:
        raise ValueError("messages[0] is an assistant turn: an answer needs a prompt before it.")
    generated = _check_generated(generated_ids, messages)
    messages = messages[: assistant_idx[-1] + 1]  # a trailing user turn is part of no training sample

    eot = set(stop_token_ids(tokenizer)) if stop_ids is None else {int(t) for t in stop_ids}
    full = _template_ids(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=kwargs)
    turns: list[_Turn] = []
    for i in assistant_idx:
        prompt = _template_ids(tokenizer, messages[:i], add_generation_prompt=True, chat_template_kwargs=kwargs)
        if max_seq_len is not None and len(prompt) >= max_seq_len:
            continue  # this answer lies beyond the kept prefix of any sample that holds it
        gen = generated[i]
        upto = _template_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, chat_template_kwargs=kwargs)
        if gen is not None and (upto[: len(prompt)] != prompt or not any(t in eot for t in upto[len(prompt):])):
            turns.append(_Turn(i, prompt, None, 0, gen, verbatim=False))
            continue
        if len(upto) <= len(prompt) and prompt[: len(upto)] == upto[: len(prompt)]:
            raise ValueError(
                f"assistant turn {i}: the chat template wrote no tokens for it (render of messages[:{i + 1}] has "
                f"{len(upto)} tokens, the generation prompt before it {len(prompt)}); the template has no "
                f"recognisable assistant span (does it drop assistant messages?), so no loss mask can be built."
            )
        if upto[: len(prompt)] != prompt:
            pos = _diff_at(prompt, upto)
            raise ValueError(
                f"template drift at assistant turn {i}: the render of messages[:{i}] with the generation prompt "
                f"is not a token prefix of the render of messages[:{i + 1}] (first difference at token {pos}: "
                f"{tokenizer.decode(prompt[pos:pos + 5])!r} vs {tokenizer.decode(upto[pos:pos + 5])!r}). Training "
                f"would see another prompt than the target generated from; often caused by leading whitespace in "
                f"the assistant content of a text-only row (rows with generated_ids are supervised on their ids), "
                f"a think block in an answer rendered with enable_thinking=False, or chat_template_kwargs "
                f"differing from those used at generation."
            )
        answer = upto[len(prompt):]
        ends = [k for k, t in enumerate(answer) if t in eot]
        if not ends:
            raise ValueError(
                f"assistant turn {i}: no end-of-turn token (stop ids {sorted(eot)}) among the rendered answer "
                f"tokens; the chat template is not supported (the loss mask must include the end-of-turn token)."
            )
        # Tokens after the end-of-turn token are template glue; a cut answer never generated its end-of-turn.
        cut = i in cut_turns
        stop = len(prompt) + ends[-1] + (0 if cut else 1)
        span = upto[len(prompt):stop]
        if gen is None and counts is not None:
            content = span if cut else span[:-1]
            text_ids = tokenizer.encode(messages[i]["content"], add_special_tokens=False)
            counts["num_turns_text_retokenized"] += int(list(content) != [int(t) for t in text_ids])
        turns.append(_Turn(i, prompt, upto, stop, gen, verbatim=gen is None or span == gen))
    if counts is not None:
        counts["num_turns_ids"] += sum(t.generated is not None for t in turns)
        counts["num_turns_text"] += sum(t.generated is None for t in turns)
    return full, turns


def _finish(ids: list[int], mask: list[int], max_seq_len: int | None) -> tuple[list[int], list[int]]:
    if max_seq_len is not None:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    return ids, mask


def _mask_error(num_supervised: int, length: int, max_seq_len: int | None, what: str = "") -> ValueError:
    return ValueError(
        f"loss mask{what} supervises {num_supervised} of {length} tokens; expected at least one supervised "
        f"and one unsupervised token (max_seq_len={max_seq_len} may cut before the first answer: raise it; "
        f"all tokens supervised means the template writes no prompt/header the mask can exclude)."
    )


def render_training_samples(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_seq_len: int | None = None,
    cut_turns: Collection[int] = (),
    chat_template_kwargs: Mapping[str, Any] | None = None,
    generated_ids: Sequence[Any] | None = None,
    stop_ids: Collection[int] | None = None,
    counts: dict[str, int] | None = None,
) -> list[RenderedSample]:
    """The training samples of one conversation (the rule shared by the cache writer and online mode).

    Every assistant turn is supervised exactly once, in a token sequence identical to the one the
    target generated it in (``render_prompt(messages[:i])`` followed by its answer). The first sample
    is the full conversation (suffix ``""``); a turn the template rewrites once later turns follow
    (Qwen3 drops earlier think blocks), or whose generated ids differ from the render of its text,
    gets its own sample ``"/turn<i>"`` ending at that turn, and is masked 0 in the full sample.
    Templates without rewriting, on answers that survive the text round trip, give one sample.
    Rule source: docs/design/data.md, "Chat templates and loss masks",
    and this module's docstring (think rule, empty turns, trailing user
    turn, generated ids).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant turn after a user turn;
            messages after the last assistant turn are ignored.
        max_seq_len: truncate every sample to this many tokens, keeping its prefix. A sample left
            with no supervised token is dropped.
        cut_turns: message indices of assistant answers cut by the generation limit (a prepared row's
            ``truncated_turns``): their content is supervised, their end-of-turn token is not (the
            target never produced it).
        chat_template_kwargs: template variables used at generation (e.g. ``{"enable_thinking": False}``).
        generated_ids: one entry per message: for a regenerated assistant turn the token ids the
            target generated (its stop token last unless cut), else None (a prepared row's
            ``generated_ids``). None: every turn is text only.
        stop_ids: the stop rule's ids (:func:`stop_token_ids`; pass the target's, generation config
            included). None: the tokenizer's eos and the template's end-of-turn.
        counts: updated in place (keys :data:`COUNT_KEYS`): turns supervised on generated ids, those
            whose render differs from the ids (supervised on the ids in a sample built from them),
            text-only turns, and text-only turns whose supervised content differs from
            ``tokenizer.encode(content)``.

    Returns:
        ``list[RenderedSample]``, the full-conversation sample first, then ``/turn<i>`` samples in turn
        order; each has ``0 < sum(loss_mask) < len(loss_mask)``.

    Raises:
        ValueError: malformed messages or ``generated_ids``, no assistant turn, template drift in a
            text-only turn (a generation-prompt render is not an exact token prefix of the render with
            the answer), a template that writes no assistant span or no end-of-turn token, a doubled
            BOS, or no sample with a supervised token left (e.g. ``max_seq_len`` cuts before the first
            answer).
    """
    if counts is not None:
        for key in COUNT_KEYS:
            counts.setdefault(key, 0)
    full, turns = _assistant_turns(tokenizer, messages, max_seq_len=max_seq_len, cut_turns=cut_turns,
                                   kwargs=chat_template_kwargs, stop_ids=stop_ids, generated_ids=generated_ids,
                                   counts=counts)
    last_index = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    full_mask = [0] * len(full)
    if turns and turns[-1].index == last_index and not turns[-1].verbatim:
        # The last answer differs from its render: the full sample is what the target saw and generated.
        full, full_mask = turns[-1].own_sample()
    own: list[RenderedSample] = []
    for turn in turns:
        if turn.index == last_index and not turn.verbatim:
            continue  # supervised in the full sample built from it
        if turn.verbatim and full[: len(turn.upto)] == turn.upto:
            full_mask[turn.start:turn.stop] = [1] * (turn.stop - turn.start)
        else:  # rewritten once later turns follow, or not what its render gives: its own sample
            own.append(RenderedSample(*_finish(*turn.own_sample(), max_seq_len), suffix=f"/turn{turn.index}"))
    if counts is not None:
        counts["num_turns_ids_not_verbatim"] += sum(not t.verbatim for t in turns)
    samples = [RenderedSample(*_finish(full, full_mask, max_seq_len), suffix="")] + own
    kept = []
    for s in samples:
        n = sum(s.loss_mask)
        if n >= len(s.loss_mask):
            raise _mask_error(n, len(s.loss_mask), max_seq_len, f" of sample {s.suffix or '(full)'!r}")
        if n > 0:
            kept.append(s)
    if not kept:
        s = samples[0]
        raise _mask_error(0, len(s.loss_mask), max_seq_len)
    return kept


def render_with_loss_mask(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_seq_len: int | None = None,
    cut_turns: Collection[int] = (),
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Render a text-only conversation as ONE sequence and build its loss mask.

    The single-sequence API: it requires every assistant turn to appear in the full render exactly as
    the target generated it. Use :func:`render_training_samples` for templates that rewrite history
    (Qwen3 multi-turn) and for rows with generated ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant turn after a user turn;
            messages after the last assistant turn are ignored (they are part of no training sample).
        max_seq_len: truncate to this many tokens, keeping the prefix.
        cut_turns: indices into ``messages`` of assistant answers cut by the generation limit
            (``truncated_turns`` of a prepared row). The template still writes their end-of-turn
            token, but the target never produced it there, so it gets mask 0 (the content stays
            supervised).
        chat_template_kwargs: template variables used at generation (e.g. ``{"enable_thinking": False}``).

    Returns:
        ``(input_ids, loss_mask)``, two lists of equal length ``T``; ``loss_mask[t]`` is 1 where token
        ``t`` is generated by the target in an assistant turn (content + end-of-turn token), else 0.

    Raises:
        ValueError: template drift (prefix property violated, including a template that rewrites an
            earlier turn once later turns follow), an assistant answer without an end-of-turn token, a
            template without assistant spans, or a mask with no supervised token / nothing but
            supervised tokens (e.g. ``max_seq_len`` cuts before the first answer).
    """
    full, turns = _assistant_turns(tokenizer, messages, max_seq_len=max_seq_len, cut_turns=cut_turns,
                                   kwargs=chat_template_kwargs, stop_ids=None, generated_ids=None, counts=None)
    mask = [0] * len(full)
    for turn in turns:
        if full[: len(turn.upto)] != turn.upto:
            pos = _diff_at(turn.upto, full)
            raise ValueError(
                f"template drift at assistant turn {turn.index}: the render of messages[:{turn.index + 1}] is not "
                f"a token prefix of the full render (first difference at token {pos}: "
                f"{tokenizer.decode(turn.upto[pos:pos + 5])!r} vs {tokenizer.decode(full[pos:pos + 5])!r}); the "
                f"template rewrites this turn once later turns follow (Qwen3 drops earlier think blocks). Use "
                f"render_training_samples, which gives such a turn its own sample."
            )
        mask[turn.start:turn.stop] = [1] * (turn.stop - turn.start)
    full, mask = _finish(full, mask, max_seq_len)
    num_supervised = sum(mask)
    if not 0 < num_supervised < len(mask):
        raise _mask_error(num_supervised, len(mask), max_seq_len)
    return full, mask


# ---------------------------------------------------------------------------------- render record

# A conversation rendered at prepare time and again when the cache is built: equal ids mean the
# template renders the prepared rows now as it did when the target answered them.
_PROBE = ({"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello! How can I help?"},
          {"role": "user", "content": "Tell me a fact."})


def template_variables(tokenizer: Any) -> list[str]:
    """The names a chat template reads besides its own locals (``messages``, ``add_generation_prompt``,
    ``bos_token``, ``tools``, ``enable_thinking``, ``strftime_now``, ``date_string``, ...), sorted;
    [] without a template or when jinja2 cannot parse it."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return []
    try:
        import jinja2
        from jinja2 import meta

        return sorted(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except Exception:  # noqa: BLE001 - transformers' own extensions ({% generation %}) may not parse here
        return []


def render_record(tokenizer: Any, *, chat_template_kwargs: Mapping[str, Any] | None,
                  stop_ids: Sequence[int]) -> dict[str, Any]:
    """What the chat template reads at render time, recorded with prepared data and in the cache
    manifest, and compared by :func:`render_record_differences` when prepared rows are rendered again.

    Keys: ``chat_template_sha256``, ``chat_template_kwargs``, ``template_variables``
    (:func:`template_variables`: e.g. ``strftime_now`` means the render depends on today's date),
    ``stop_token_ids``, ``probe_sha256`` (the ids of a fixed three-message conversation rendered
    with and without the generation prompt, with these kwargs: catches anything else that changes
    the tokens, e.g. a default system prompt, the date, the tokenizer) and ``render_date`` (only when
    the template reads ``strftime_now``).
    """
    import hashlib
    import json

    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    try:
        probe = [_template_ids(tokenizer, _PROBE, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs),
                 _template_ids(tokenizer, _PROBE[:2], add_generation_prompt=False,
                               chat_template_kwargs=chat_template_kwargs)]
        probe_sha = hashlib.sha256(json.dumps(probe).encode()).hexdigest()
    except Exception as exc:  # noqa: BLE001 - a template may refuse the probe; record why
        probe_sha = f"error: {type(exc).__name__}"
    variables = template_variables(tokenizer)
    record: dict[str, Any] = {
        "chat_template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "template_variables": variables,
        "stop_token_ids": sorted(int(t) for t in stop_ids),
        "probe_sha256": probe_sha,
    }
    if "strftime_now" in variables:
        record["render_date"] = datetime.datetime.now().date().isoformat()  # the clock strftime_now reads
    return record


def render_record_differences(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The fields of two :func:`render_record` dicts that differ, as readable lines (empty: same
    render). ``render_date`` alone is not a difference (the probe says whether the date matters)."""
    lines = []
    for key in ("chat_template_sha256", "chat_template_kwargs", "stop_token_ids", "probe_sha256"):
        if key in recorded and recorded.get(key) != now.get(key):
            lines.append(f"{key}: prepared {recorded.get(key)!r}, now {now.get(key)!r}")
    if lines and "strftime_now" in (now.get("template_variables") or []):
        lines.append(f"the chat template reads strftime_now (today's date): prepared on "
                     f"{recorded.get('render_date', '?')}, rendering on {now.get('render_date', '?')}")
    return lines
