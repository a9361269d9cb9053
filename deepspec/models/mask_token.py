"""Choice and validation of the draft's mask token (DESIGN section 5, "Mask token").

The block input is ``[x_a, m, m, ..., m]``; ``m`` must be an embedding row that no real text ever
produces. Preference order: a spare embedding row beyond the tokenizer (Qwen3: 151,936 rows for
151,669 tokens, the original DeepSpec uses 151669), else a reserved special token named by the user
(SmolLM2 has no spare row; ``<repo_name>`` is a reserved code-pretraining token that chat text never
contains). pad and eos are always refused: they occur in every training sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Reserved special tokens that chat data never contains, tried in order when the embedding has no
# spare row. SmolLM2's tokenizer defines all of them (ids 3-5).
RESERVED_MASK_TOKEN_CANDIDATES = ("<repo_name>", "<reponame>", "<file_sep>", "<filename>")


def choose_mask_token_id(tokenizer, num_embeddings: int, requested: str | int | None = None) -> int:
    """Return the mask token id for a target.

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        num_embeddings: rows of the target's input embedding (may exceed ``len(tokenizer)``).
        requested: a token string or id chosen by the user; ``None`` picks automatically.

    Raises:
        ValueError: the requested token is unknown, out of range, or equals pad/eos; or no
            automatic choice exists (then the message says to pass ``--mask-token``).
    """
    if requested is None:
        if num_embeddings > len(tokenizer):
            mask_id = len(tokenizer)
        else:
            vocab = tokenizer.get_vocab()
            found = [vocab[t] for t in RESERVED_MASK_TOKEN_CANDIDATES if t in vocab]
            if not found:
                raise ValueError(
                    f"mask_token: the target's embedding has no spare row ({num_embeddings} rows for "
                    f"{len(tokenizer)} tokens) and none of the reserved tokens "
                    f"{RESERVED_MASK_TOKEN_CANDIDATES} exists; pass --mask-token with a reserved special "
                    "token that never occurs in your data"
                )
            mask_id = found[0]
    elif isinstance(requested, int) or str(requested).isdigit():
        mask_id = int(requested)
    else:
        mask_id = tokenizer.convert_tokens_to_ids(requested)
        if mask_id is None or mask_id == tokenizer.unk_token_id:
            raise ValueError(f"mask_token: {requested!r} is not a token of this tokenizer; pass a token it defines")
    validate_mask_token_id(mask_id, num_embeddings=num_embeddings, forbidden_ids=special_ids_of(tokenizer))
    return mask_id


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
