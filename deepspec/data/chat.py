"""Chat rendering through the tokenizer's own template, with the training loss mask.

Rule (DESIGN.md s.3): the loss mask is 1 exactly on the tokens the target *generates* in an
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
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# End-of-turn tokens of the chat templates DeepSpec knows (ChatML, Llama 3, Gemma). The tokenizer's
# eos token is always included as well.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")


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


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's eos id(s) plus known end-of-turn tokens."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    vocab = tokenizer.get_vocab()
    for tok in _END_OF_TURN_TOKENS:
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return ids


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
            no chat template, or a doubled BOS.
    """
    _check_messages(messages)
    if not messages:
        raise ValueError("messages is empty: a prompt needs at least one user message.")
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is an assistant turn: a prompt must end with a user (or system) "
                         "message; drop the final assistant turn to build the prompt that produced it.")
    return _template_ids(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)


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
    upto: list[int]  # render of messages[:index+1] without the generation prompt
    start: int  # first supervised position in ``upto`` (= len(prompt))
    stop: int  # one past the last supervised position in ``upto``


def _diff_at(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _assistant_turns(tokenizer: Any, messages: Sequence[Mapping[str, str]], *, max_seq_len: int | None,
                     cut_turns: Collection[int], kwargs: Mapping[str, Any] | None) -> tuple[list[int], list[_Turn]]:
    """Validate ``messages``; return (full render up to the last assistant turn, the assistant turns).

    Turns whose generation prompt is already ``>= max_seq_len`` tokens are left out (nothing of them
    survives truncation).
    """
    _check_messages(messages)
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len={max_seq_len}: expected a positive integer or None.")
    assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_idx:
        raise ValueError("conversation has no assistant turn: nothing to supervise.")
    if assistant_idx[0] == 0:
        raise ValueError("messages[0] is an assistant turn: an answer needs a prompt before it.")
    messages = messages[: assistant_idx[-1] + 1]  # a trailing user turn is part of no training sample

    eot = end_of_turn_ids(tokenizer)
    full = _template_ids(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=kwargs)
    turns: list[_Turn] = []
    for i in assistant_idx:
        prompt = _template_ids(tokenizer, messages[:i], add_generation_prompt=True, chat_template_kwargs=kwargs)
        if max_seq_len is not None and len(prompt) >= max_seq_len:
            continue  # this answer lies beyond the kept prefix of any sample that holds it
        upto = _template_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, chat_template_kwargs=kwargs)
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
                f"the assistant content (strip it), a think block in an answer rendered with enable_thinking=False, "
                f"or chat_template_kwargs differing from those used at generation."
            )
        answer = upto[len(prompt):]
        ends = [k for k, t in enumerate(answer) if t in eot]
        if not ends:
            raise ValueError(
                f"assistant turn {i}: no end-of-turn token (ids {sorted(eot)}) among the rendered answer tokens; "
                f"the chat template is not supported (the loss mask must include the end-of-turn token)."
            )
        # Tokens after the end-of-turn token are template glue; a cut answer never generated its end-of-turn.
        stop = len(prompt) + ends[-1] + (0 if i in cut_turns else 1)
        turns.append(_Turn(i, upto, len(prompt), stop))
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
) -> list[RenderedSample]:
    """The training samples of one conversation (the rule shared by the cache writer and online mode).

    Every assistant turn is supervised exactly once, in a token sequence identical to the one the
    target generated it in (``render_prompt(messages[:i])`` followed by its answer). The first sample
    is the full conversation (suffix ``""``); a turn the template rewrites once later turns follow
    (Qwen3 drops earlier think blocks) gets its own sample ``"/turn<i>"`` rendered from
    ``messages[:i+1]``, and is masked 0 in the full sample. Templates without rewriting give one sample.
    Rule source: DESIGN.md s.3 and this module's docstring (think rule, empty turns, trailing user turn).

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

    Returns:
        ``list[RenderedSample]``, the full-conversation sample first, then ``/turn<i>`` samples in turn
        order; each has ``0 < sum(loss_mask) < len(loss_mask)``.

    Raises:
        ValueError: malformed messages, no assistant turn, template drift (a generation-prompt render is
            not an exact token prefix of the render with the answer), a template that writes no
            assistant span or no end-of-turn token, a doubled BOS, or no sample with a supervised token
            left (e.g. ``max_seq_len`` cuts before the first answer).
    """
    full, turns = _assistant_turns(tokenizer, messages, max_seq_len=max_seq_len, cut_turns=cut_turns,
                                   kwargs=chat_template_kwargs)
    full_mask = [0] * len(full)
    own: list[RenderedSample] = []
    for turn in turns:
        if full[: len(turn.upto)] == turn.upto:
            full_mask[turn.start:turn.stop] = [1] * (turn.stop - turn.start)
        else:  # rewritten once later turns follow: supervised in its own sample, 0 where rewritten
            mask = [0] * len(turn.upto)
            mask[turn.start:turn.stop] = [1] * (turn.stop - turn.start)
            own.append(RenderedSample(*_finish(turn.upto, mask, max_seq_len), suffix=f"/turn{turn.index}"))
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
    """Render a conversation as ONE sequence and build its loss mask.

    The single-sequence API: it requires every assistant turn to appear in the full render exactly as
    the target generated it. Use :func:`render_training_samples` for templates that rewrite history
    (Qwen3 multi-turn).

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
                                   kwargs=chat_template_kwargs)
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
