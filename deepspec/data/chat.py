"""Chat rendering through the tokenizer's own template, with the training loss mask.

Rule (DESIGN.md s.3): the loss mask is 1 exactly on the tokens the target *generates* in an
assistant turn: the assistant content and its end-of-turn token. It is 0 on system and user turns,
on the assistant header (the generation prompt supplies it), and on template text written after the
end-of-turn token (ChatML writes ``<|im_end|>\\n``; the model stops at ``<|im_end|>``, the ``\\n`` is
template glue and is never generated).

How the mask is found (no template-specific parsing): for each assistant turn ``i`` the template
renders ``messages[:i]`` with the generation prompt and ``messages[:i+1]`` without it. The former must
be an exact token prefix of the latter, and the latter of the full render (otherwise training and
inference would see different prompts: "template drift", a ValueError). The new tokens are the
assistant's answer; the mask covers them up to and including the last end-of-turn token among them.

Tokens are always produced by ``apply_chat_template(tokenize=True)``: special tokens written by the
template are never added a second time (no duplicated BOS). The same function,
:func:`render_prompt`, builds prompts for regeneration (prepare) and for evaluation.
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
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt,
        **dict(chat_template_kwargs or {}),
    )
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    ids = [int(t) for t in out]
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
    :func:`render_with_loss_mask`) and evaluation.

    Raises:
        ValueError: empty ``messages``, the last message is an assistant turn, or a malformed message.
    """
    _check_messages(messages)
    if not messages:
        raise ValueError("messages is empty: a prompt needs at least one user message.")
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is an assistant turn: a prompt must end with a user (or system) "
                         "message; drop the final assistant turn to build the prompt that produced it.")
    return _template_ids(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)


def render_with_loss_mask(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_seq_len: int | None = None,
    cut_turns: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """Render a conversation and build its loss mask.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant turn after a user turn.
        max_seq_len: truncate to this many tokens, keeping the prefix.
        cut_turns: indices into ``messages`` of assistant answers cut by the generation limit
            (``truncated_turns`` of a prepared row). The template still writes their end-of-turn
            token, but the target never produced it there, so it gets mask 0 (the content stays
            supervised).

    Returns:
        ``(input_ids, loss_mask)``, two lists of equal length ``T``; ``loss_mask[t]`` is 1 where token
        ``t`` is generated by the target in an assistant turn (content + end-of-turn token), else 0.

    Raises:
        ValueError: template drift (prefix property violated), an assistant answer without an
            end-of-turn token, or a mask with no supervised token / nothing but supervised tokens
            (e.g. ``max_seq_len`` cuts before the first answer).
    """
    _check_messages(messages)
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len={max_seq_len}: expected a positive integer or None.")
    assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_idx:
        raise ValueError("conversation has no assistant turn: nothing to supervise.")
    if assistant_idx[0] == 0:
        raise ValueError("messages[0] is an assistant turn: an answer needs a prompt before it.")

    eot = end_of_turn_ids(tokenizer)
    full = _template_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for i in assistant_idx:
        prompt = _template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        if max_seq_len is not None and len(prompt) >= max_seq_len:
            break  # this and later answers lie beyond the kept prefix (saves quadratic re-renders)
        upto = _template_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            bad = prompt if upto[: len(prompt)] != prompt else upto
            ref = upto if bad is prompt else full
            pos = next((k for k, (a, b) in enumerate(zip(bad, ref)) if a != b), min(len(bad), len(ref)))
            raise ValueError(
                f"template drift at assistant turn {i}: the render of messages[:{i}] "
                f"{'with the generation prompt' if bad is prompt else ''} is not a token prefix of the longer render "
                f"(first difference at token {pos}: {tokenizer.decode(bad[pos:pos + 5])!r} vs "
                f"{tokenizer.decode(ref[pos:pos + 5])!r}). Training would see other prompts than inference; "
                f"often caused by leading whitespace in the assistant content (strip it) or a template that "
                f"rewrites earlier turns."
            )
        answer = upto[len(prompt):]
        ends = [k for k, t in enumerate(answer) if t in eot]
        if not ends:
            raise ValueError(
                f"assistant turn {i}: no end-of-turn token (ids {sorted(eot)}) among the rendered answer tokens; "
                f"the chat template is not supported (the loss mask must include the end-of-turn token)."
            )
        stop = len(prompt) + ends[-1] + 1  # tokens after the end-of-turn token are template glue
        if i in cut_turns:
            stop = len(prompt) + ends[-1]  # a cut answer: its end-of-turn token was never generated
        for t in range(len(prompt), stop):
            mask[t] = 1

    if max_seq_len is not None:
        full, mask = full[:max_seq_len], mask[:max_seq_len]
    num_supervised = sum(mask)
    if not 0 < num_supervised < len(mask):
        raise ValueError(
            f"loss mask supervises {num_supervised} of {len(mask)} tokens; expected at least one supervised "
            f"and one unsupervised token (max_seq_len={max_seq_len} may cut before the first answer: raise it)."
        )
    return full, mask


@dataclass(frozen=True)
class RenderedSample:
    """One training sample of a conversation: token ids, loss mask (equal length) and a name suffix
    (``""`` for the whole conversation; ``"/turn<i>"`` for a sample that ends at assistant turn ``i``)."""

    input_ids: list[int]
    loss_mask: list[int]
    suffix: str = ""


def render_training_samples(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_seq_len: int | None = None,
    cut_turns: Collection[int] = (),
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[RenderedSample]:
    """The training samples of one conversation (the rule shared by the cache writer and online mode).

    Raises:
        ValueError: as :func:`render_with_loss_mask`.
    """
    ids, mask = render_with_loss_mask(tokenizer, messages, max_seq_len=max_seq_len, cut_turns=cut_turns)
    return [RenderedSample(ids, mask)]
