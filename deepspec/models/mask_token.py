"""Choice and validation of the draft's mask token (DESIGN section 5, "Mask token").

The block input is ``[x_a, m, m, ..., m]``; ``m`` must be an embedding row that no real text ever
produces. Automatic preference order (:func:`choose_mask_token_id`):

1. the tokenizer's declared ``mask_token`` (Gemma declares ``<mask>``);
2. a reserved special token that chat text never contains, as real tokenizers spell it
   (SmolLM2: ``<repo_name>``; Qwen2.5/Qwen3: ``<|repo_name|>``, ``<|file_sep|>``, ``<|fim_pad|>``);
3. a padding-only token that fills the vocabulary (``<unused0>``, ``<|reserved_special_token_0|>``, ...);
4. a spare embedding row beyond the tokenizer (the original DeepSpec uses Qwen3's row 151669).

pad, eos and bos are never chosen: they occur in every training sequence. ``deepspec train`` then
checks that the chosen token never occurs in the training data (:func:`check_mask_token_absent`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

# Reserved special tokens that chat data never contains, tried in order after the declared mask token.
# SmolLM2's tokenizer defines the first ones (ids 3-5); Qwen2.5 and Qwen3 spell theirs with bars.
RESERVED_MASK_TOKEN_CANDIDATES = (
    "<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<|repo_name|>", "<|file_sep|>", "<|fim_pad|>",
)
# Tokens that only pad the vocabulary to a round size (Gemma, Llama 3, Phi-3), tried after the reserved ones.
PADDING_ONLY_TOKEN_PATTERNS = (r"<unused\d+>", r"\[unused\d+\]", r"<\|reserved_special_token_\d+\|>", r"<\|dummy_\d+\|>")


def choose_mask_token_id(tokenizer, num_embeddings: int, requested: str | int | None = None) -> int:
    """Return the mask token id for a target.

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        num_embeddings: rows of the target's input embedding (may exceed ``len(tokenizer)``).
        requested: a token string or id chosen by the user; ``None`` picks automatically, in the order
            of this module's docstring (declared mask token, reserved, padding-only, spare row).

    Raises:
        ValueError: the requested token is unknown, out of range, or equals pad/eos; or no
            automatic choice exists (then the message says to pass ``--mask-token``).
    """
    if requested is None:
        mask_id = _automatic_mask_token_id(tokenizer, num_embeddings)
    elif isinstance(requested, int) or str(requested).isdigit():
        mask_id = int(requested)
    else:
        mask_id = tokenizer.convert_tokens_to_ids(requested)
        if mask_id is None or mask_id == tokenizer.unk_token_id:
            raise ValueError(f"mask_token: {requested!r} is not a token of this tokenizer; pass a token it defines")
    validate_mask_token_id(mask_id, num_embeddings=num_embeddings, forbidden_ids=special_ids_of(tokenizer))
    return mask_id


def _automatic_mask_token_id(tokenizer, num_embeddings: int) -> int:
    """The first usable candidate of the module docstring's order; ValueError when none exists."""
    forbidden = set(special_ids_of(tokenizer).values())
    vocab = tokenizer.get_vocab()
    declared = getattr(tokenizer, "mask_token", None)
    named = ((str(declared),) if declared else ()) + RESERVED_MASK_TOKEN_CANDIDATES
    candidates = [vocab[t] for t in named if t in vocab]
    candidates += sorted(vocab[t] for t in vocab if any(re.fullmatch(p, t) for p in PADDING_ONLY_TOKEN_PATTERNS))
    if num_embeddings > len(tokenizer):
        candidates.append(len(tokenizer))
    for mask_id in candidates:
        if mask_id not in forbidden and 0 <= mask_id < num_embeddings:
            return mask_id
    raise ValueError(
        f"mask_token: found no declared mask token, none of the reserved tokens {RESERVED_MASK_TOKEN_CANDIDATES}, "
        f"no padding-only token and no spare embedding row ({num_embeddings} rows for {len(tokenizer)} tokens); "
        "pass --mask-token with a reserved special token that never occurs in your data"
    )


def special_ids_of(tokenizer) -> dict[str, int]:
    """The pad/eos/bos ids of a tokenizer that the mask token must never equal."""
    out = {}
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            out[name] = int(value)
    return out


def validate_mask_token_id(mask_id: int, *, num_embeddings: int, forbidden_ids: dict[str, int]) -> None:
    """Raise ValueError if ``mask_id`` is out of the embedding range or equals a pad/eos/bos id."""
    if not 0 <= mask_id < num_embeddings:
        raise ValueError(
            f"mask_token_id: expected an id in [0, {num_embeddings}) (the target embedding rows), got {mask_id}"
        )
    for name, value in forbidden_ids.items():
        if mask_id == value:
            raise ValueError(
                f"mask_token_id: {mask_id} equals the tokenizer's {name}; the mask token must never occur in "
                "real text, so pad/eos/bos are refused. Use a spare embedding row or a reserved special token"
            )


def check_mask_token_absent(mask_id: int, input_ids_chunks: Iterable[torch.Tensor]) -> int:
    """Verify the mask token never occurs in the training data; return the number of tokens scanned.

    Raises:
        ValueError: naming the chunk index where the mask token occurs.
    """
    num_tokens = 0
    for index, ids in enumerate(input_ids_chunks):
        if bool((ids == mask_id).any()):
            raise ValueError(
                f"mask_token_id {mask_id} occurs in training sample {index}; the mask token must never occur "
                "in the data. Choose another reserved token with --mask-token"
            )
        num_tokens += ids.numel()
    return num_tokens
