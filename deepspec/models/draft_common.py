"""Pieces every draft model shares, whatever its algorithm: the frozen copies of the target's embedding
and ``lm_head``, the reduced draft vocabulary's plumbing (``d2t``, :mod:`deepspec.models.vocab`), and the
per-head q/k norm + head split of the target family's attention.

Legend: N draft vocab (= V unless reduced), V target vocab, D draft hidden, B batch, T positions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from deepspec.models.vocab import scatter_to_target, validate_d2t
from deepspec.target.load import target_fingerprint


def copy_target_embeddings(model: nn.Module, target_model: nn.Module, config_builder: str) -> nn.Module:
    """Copy (not share) the target's input embedding and lm_head into the draft's frozen
    ``embed_tokens`` / ``lm_head`` (in the draft's dtype), record the target's fingerprint in
    ``model.config.target_fingerprint`` and move the draft to the target's device.

    A draft with a reduced vocabulary (a ``d2t`` buffer, already set) gets the target's ``lm_head`` rows
    ``d2t`` (``[N, D]``) and keeps the full matrix as the non-persistent buffer ``target_lm_weight``
    (never saved; the training loss computes the target distribution with it).

    Raises:
        ValueError: the shapes differ (the draft config was not derived from this target; the message
            names ``config_builder``, the function to build it with).
    """
    emb = target_model.get_input_embeddings().weight
    head = target_model.get_output_embeddings().weight
    d2t_N = getattr(model, "d2t", None)
    want_emb = tuple(model.embed_tokens.weight.shape)
    want_head = want_emb if d2t_N is not None else tuple(model.lm_head.weight.shape)
    if tuple(emb.shape) != want_emb or tuple(head.shape) != want_head:
        raise ValueError(f"{type(model).__name__}.from_target: expected target embedding/lm_head of shape "
                         f"{want_emb}, received {tuple(emb.shape)} / {tuple(head.shape)}. Build the config with "
                         f"{config_builder}(target.config).")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb.detach().to(model.embed_tokens.weight.dtype))
        if d2t_N is None:
            model.lm_head.weight.copy_(head.detach().to(model.lm_head.weight.dtype))
        else:
            model.lm_head.weight.copy_(head.detach()[d2t_N.to(head.device)].to(model.lm_head.weight.dtype))
            model.target_lm_weight = head.detach().to(model.lm_head.weight.dtype).clone()
    model.config.target_fingerprint = target_fingerprint(target_model)  # saved with the draft, checked at eval
    return model.to(emb.device)


class DraftVocabMixin:
    """Token-side plumbing shared by the DSpark/DFlash and Eagle3 drafts (an ``nn.Module`` with a
    ``config``, ``embed_tokens`` and an ``lm_head``): the family's input embedding rule (:meth:`embed`),
    and the reduced draft vocabulary: the ``d2t`` buffer (int64 ``[N]``, saved), the full target
    ``lm_head`` for the training loss (``target_lm_weight``, not saved), and the id map."""

    def _init_draft_vocab(self, config) -> None:
        """Call in ``__init__``: registers ``d2t`` (identity placeholder; set by :func:`draft_from_target`
        or loaded) when ``config.draft_vocab_size`` is set, else ``self.d2t = None``."""
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long), persistent=True)
        else:
            self.d2t = None
        self.register_buffer("target_lm_weight", None, persistent=False)

    def embed(self, ids: Tensor) -> Tensor:
        """The draft's input embedding of target ids (any shape ``[...]`` -> ``[..., D]``, the embedding's
        dtype): ``embed_tokens`` times ``config.embed_scale``, the target family's rule (Gemma scales by
        sqrt(D), in the weight's dtype, as ``Gemma3TextScaledWordEmbedding``; 1 elsewhere)."""
        e = self.embed_tokens(ids)
        scale = self.config.embed_scale
        return e if scale == 1.0 else e * torch.tensor(scale, dtype=e.dtype, device=e.device)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft ids (indices into the logits) -> target ids (int64, same shape); the identity without
        a reduced vocabulary."""
        return draft_ids.long() if self.d2t is None else self.d2t[draft_ids.long()]

    def target_probs(self, q_W: Tensor | None) -> Tensor | None:
        """A draft distribution over draft ids (fp32 ``[..., W]``) -> over target ids ``[..., V]``, zeros outside
        the draft vocabulary (:func:`~deepspec.models.vocab.scatter_to_target`); the identity without a reduced
        vocabulary, and None (greedy: no distribution) stays None."""
        if q_W is None or self.d2t is None:
            return q_W
        return scatter_to_target(q_W, self.d2t, self.config.vocab_size)

    def frozen_as(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """A frozen weight of this draft (``lm_head.weight``, ``target_lm_weight``: never trained) in
        ``dtype``, the compute dtype of a bf16 autocast step: ``weight`` itself when it has that dtype,
        else a copy made once and kept while ``weight`` is unchanged (its version counter; a
        ``load_state_dict`` makes a new copy). Autocast re-casts a weight that needs no gradient on
        every call (its cast cache holds only leaves that require grad), which for the lm_head is once
        per loss chunk and again in each chunk's recomputation. Values: the same as autocast's cast."""
        if weight.dtype == dtype:
            return weight
        cache = self.__dict__.setdefault("_frozen_casts", {})
        key = (id(weight), dtype)
        hit = cache.get(key)
        if hit is None or hit[0] is not weight or hit[1] != weight._version or hit[2].device != weight.device:
            hit = (weight, weight._version, weight.detach().to(dtype))
            cache[key] = hit
        return hit[2]

    @property
    def target_lm_head_weight(self) -> Tensor:
        """The target's full ``lm_head`` weight ``[V, D]`` (what the training loss scores the target
        distribution with): ``lm_head.weight`` itself, or ``target_lm_weight`` with a reduced vocabulary.

        Raises:
            ValueError: a reduced-vocabulary draft loaded from disk (only ``from_target`` sets it).
        """
        if self.d2t is None:
            return self.lm_head.weight
        if self.target_lm_weight is None:
            name = type(self).__name__
            raise ValueError(f"{name}.target_lm_weight: a reduced-vocabulary draft needs the target's full lm_head to "
                             "compute its training loss; received None (the draft was loaded from disk). Build it with "
                             f"{name}.from_target(target, config, d2t=...) and load the weights into that.")
        return self.target_lm_weight


def draft_from_target(cls, target_model: nn.Module, config, d2t: Tensor | None, config_builder: str):
    """``cls(config)`` with its reduced vocabulary set to ``d2t`` and the target's embedding / lm_head
    copied (:func:`copy_target_embeddings`).

    Raises:
        ValueError: ``d2t`` missing while ``config.draft_vocab_size`` is set, given while it is not, or
            invalid (:func:`deepspec.models.vocab.validate_d2t`); target shapes that do not fit.
    """
    where = f"{cls.__name__}.from_target.d2t"
    if (d2t is None) != (config.draft_vocab_size is None):
        raise ValueError(f"{where}: expected a draft -> target id map exactly when config.draft_vocab_size is set "
                         f"(received draft_vocab_size={config.draft_vocab_size}, "
                         f"d2t={'None' if d2t is None else tuple(d2t.shape)}). Pass "
                         "d2t=select_draft_vocab(counts, N), or leave draft_vocab_size None.")
    model = cls(config)
    if d2t is not None:
        model.d2t.copy_(validate_d2t(d2t, vocab_size=config.vocab_size, draft_vocab_size=config.draft_vocab_size,
                                     source=where))
    return copy_target_embeddings(model, target_model, config_builder)


def load_draft_weights(folder: Path, config_name: str, weights_name: str, who: str) -> dict[str, Tensor]:
    """The state dict of a draft folder's ``weights_name`` (safetensors), after checking that ``config_name``
    is there too.

    Raises:
        FileNotFoundError: either file missing (the message names both and says where such a folder comes from).
        ValueError: a weights file safetensors cannot read (truncated, e.g. by an interrupted copy), naming it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not (folder / config_name).is_file() or not (folder / weights_name).is_file():
        raise FileNotFoundError(f"{who}: expected {folder / config_name} and {folder / weights_name}; pass a draft "
                                "folder written by `deepspec train` (a checkpoint-NNNNNN folder or its run folder)")
    try:
        return load_file(str(folder / weights_name))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{folder / weights_name}: unreadable ({e}); the file is damaged or incomplete (an "
                         "interrupted copy?). Copy the draft folder again, or pass another checkpoint of its "
                         "run") from None


def check_saved_d2t(state: dict[str, Tensor], config, source: str) -> dict[str, Tensor]:
    """Check the ``d2t`` entry of a loaded state dict against ``config.draft_vocab_size`` (before
    ``load_state_dict``, whose size errors would not name the field); returns ``state``.

    Raises:
        ValueError: naming ``source`` and ``d2t``: present for a full-vocabulary config, missing for a
            reduced one, or invalid (:func:`deepspec.models.vocab.validate_d2t`).
    """
    source = f"{source}: d2t"
    if config.draft_vocab_size is None and "d2t" in state:
        raise ValueError(f"{source}: expected no draft -> target id map (config.json has draft_vocab_size null), "
                         f"received one of {tuple(state['d2t'].shape)}. The weights and config.json belong to "
                         "different drafts.")
    if config.draft_vocab_size is not None:
        if "d2t" not in state:
            raise ValueError(f"{source}: expected a draft -> target id map of {config.draft_vocab_size} entries "
                             "(config.json draft_vocab_size), received none. Re-save the draft with DeepSpec.")
        state["d2t"] = validate_d2t(state["d2t"], vocab_size=config.vocab_size,
                                    draft_vocab_size=config.draft_vocab_size, source=source)
    return state


def qk_norms(c) -> tuple[nn.Module | None, nn.Module | None]:
    """The family's per-head q/k RMSNorms when the draft has them (``c.qk_norm``: Qwen3 and Gemma 3
    targets, or ``--draft-backbone qwen3``), else ``(None, None)``."""
    if not c.qk_norm:
        return None, None
    Norm = c.family_class("RMSNorm")
    return Norm(c.head_dim, eps=c.rms_norm_eps), Norm(c.head_dim, eps=c.rms_norm_eps)


def split_heads(x_BTX: Tensor, n_heads: int, head_dim: int, norm: nn.Module | None) -> Tensor:
    """``[B, T, n_heads*head_dim]`` -> ``[B, n_heads, T, head_dim]``, with the per-head norm applied first."""
    B, T, _ = x_BTX.shape
    x = x_BTX.view(B, T, n_heads, head_dim)
    if norm is not None:
        x = norm(x)
    return x.transpose(1, 2)
