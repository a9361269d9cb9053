"""DSpark / DFlash block-parallel draft model (docs/design/draft-models.md); its drafting loop is :mod:`.proposer`.

Legend: B batch, S sequence length, A anchors (blocks), K block_size, Q = A*K block slots,
D draft hidden (= target hidden H), F = n_layers * H target feature width, V target vocab, N draft
vocab (= V unless ``draft_vocab_size`` reduces it; logits are over N), r Markov rank,
T a run of committed context positions, Hq query heads, Hk KV heads, d head_dim.

Architecture (parameter names follow the original DeepSpec DSpark checkpoints):
  embed_tokens (frozen copy of the target's), fc (Linear F -> D, no bias), hidden_norm,
  layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj [, self_attn.{q,k}_norm for qwen3],
  post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, lm_head (frozen copy of the target's
  rows ``d2t``: ``[N, D]``), markov_head.{markov_w1 (Embedding V x r: indexed by the previous *target*
  id), markov_w2 (Linear r -> N, no bias)} (+ ``gate_proj`` for the ``gated`` variant, ``joint_proj``
  for ``rnn``: see :class:`MarkovHead`), confidence_head.proj (Linear D + r -> 1, with bias; D -> 1 with
  ``confidence_head_with_markov`` false), and with
  a reduced vocabulary the buffer ``d2t`` (int64 ``[N]``, absolute target ids: :mod:`deepspec.models.vocab`).

Each draft layer attends from the block's hidden states (queries) to
``cat(context K/V, block K/V)``: context K/V are that layer's own k/v projections of
``hidden_norm(fc(target_features))`` (no input_layernorm, as in the original), RoPE'd at their
positions; block K/V come from the block's normalised hidden states. The mask is
:mod:`deepspec.models.mask`. The norms, MLP, rotary embedding and ``apply_rotary_pos_emb`` are the
target family's transformers classes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspec.algorithms.dspark.config import DraftConfig
from deepspec.models.calibration import CALIBRATION_NAME, ConfidenceCalibration, load_calibration
from deepspec.models.config import CONFIG_NAME, WEIGHTS_NAME, save_draft_folder
from deepspec.models.draft_common import (
    DraftVocabMixin, check_saved_d2t, draft_from_target, load_draft_weights, qk_norms, split_heads)
from deepspec.models.mask import dense_block_mask, flex_block_mask


@dataclass
class DraftTrainOutput:
    """Training forward result. ``logits_BAKV`` include the Markov bias (true previous tokens).

    With ``forward_train(..., defer_logits=True)`` ``logits_BAKV`` is None and the loss computes the
    logits of the supervised slots only, chunk by chunk, as ``head_logits(hidden, markov_input)``
    (:meth:`DSparkDraftModel.head_logits`) from ``hidden_BAKD`` and ``markov_input_BAKr`` (the rank-r
    input of the Markov head's output layer; None without a Markov head): the same values, without a
    ``[B, A, K, N]`` tensor.
    """

    logits_BAKV: Tensor | None
    confidence_logits_BAK: Tensor | None
    hidden_BAKD: Tensor
    markov_input_BAKr: Tensor | None = None
    head_logits: Callable[[Tensor, Tensor | None], Tensor] | None = None


@dataclass
class DraftContextCache:
    """Per-layer context K/V of committed positions (inference). ``k[l]``/``v[l]``: ``[1, Hk, T, d]``
    with RoPE applied at positions ``0..T-1``. ``length`` = number of cached positions."""

    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    length: int = 0

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop: expected 0 <= n <= length={self.length}, received {n}.")
        self.k = [t[:, :, :n] for t in self.k]
        self.v = [t[:, :, :n] for t in self.v]
        self.length = n


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process, with dynamic shapes: one graph serves every sequence
    length and anchor count (a compile per shape would hit torch._dynamo's recompile limit)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


FLEX_FALLBACK_ERROR = (
    "flex_attention: torch.compile recompiled it past torch._dynamo's recompile limit ({limit}); it would "
    "now fall back to the unfused implementation, which materialises the full [queries x keys] score "
    "matrix per head. Report it with the shapes (q {q}, kv {kv}); meanwhile train with the dense mask "
    "(use_flex=False) or raise torch._dynamo.config.recompile_limit.")

_BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                       "q_indices", "full_q_num_blocks", "full_q_indices")


def flex_block_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, *, enable_gqa: bool,
                         compiled: bool = True) -> Tensor:
    """flex_attention of ``q`` ``[B, Hq, Q, d]`` and ``k``/``v`` ``[B, Hk, T, d]`` under ``block_mask``
    (:func:`deepspec.models.mask.flex_block_mask`), ``[B, Hq, Q, d]``.

    A mask built with ``pad_to_blocks`` is longer than ``Q`` / ``T``: q, k and v are zero-padded to its
    ``seq_lengths`` (the padding is masked) and the extra rows dropped. ``compiled``: the compiled kernel
    (:func:`_compiled_flex_attention`; its block-count dimensions marked dynamic, so one graph serves
    every length), never the unfused fallback; False: eager flex (materialises the scores: CPU tests).

    Dtypes: under an active autocast on q's device, q, k and v are cast to the autocast dtype first.
    flex_attention is not an autocast op, and the q/k RMSNorms keep float32 weights, so without the cast
    q and k arrive in float32 beside a bf16 v and the compiled kernel computes in float32, off the
    tensor cores. The three then must share one dtype.

    Raises:
        RuntimeError: torch.compile would fall back to eager (recompile limit hit) instead of the fused kernel.
        ValueError: q, k and v in different dtypes outside autocast.
    """
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    from torch.nn.attention.flex_attention import flex_attention

    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flex_block_attention: q, k, v in {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype "
                         "(or run under torch.autocast)")
    Q, T = q.shape[2], k.shape[2]
    q_len, kv_len = block_mask.seq_lengths
    if q_len != Q:
        q = F.pad(q, (0, 0, 0, q_len - Q))
    if kv_len != T:
        k, v = F.pad(k, (0, 0, 0, kv_len - T)), F.pad(v, (0, 0, 0, kv_len - T))
    if not compiled:
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)[:, :, :Q]
    for name in _BLOCK_MASK_TENSORS:  # [B, H, blocks(, blocks)]: the block counts vary with the lengths
        t = getattr(block_mask, name, None)
        if t is not None:
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
    try:  # no duck sizing: equal query and key lengths at the first call must not become a guard
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), fx_config.patch(use_duck_shape=False):
            out = _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        raise RuntimeError(FLEX_FALLBACK_ERROR.format(limit=torch._dynamo.config.recompile_limit,
                                                      q=tuple(q.shape), kv=tuple(k.shape))) from exc
    return out[:, :, :Q]


class MarkovHead(nn.Module):
    """``vanilla``: rank-r bigram logit bias ``markov_w2(markov_w1[prev_token])`` (DSpark paper Eq. 5).

    Every variant exposes the same two calls, so training and inference apply the same head:
      * :meth:`step` ``(prev_ids_X, hidden_XD, state) -> (bias_XV, feats_Xr, state)``: one slot
        (``state`` is ``None`` at the first slot of a block; the proposer threads it along);
      * :meth:`block` ``(prev_ids_XK, hidden_XKD) -> (bias_XKV, feats_XKr)``: teacher-forced over a
        block's K slots (training and the consistency tests), equal to K calls of :meth:`step`.
    ``hidden`` is the slot's final (normed) draft hidden state, the one ``lm_head`` reads;
    ``feats = markov_w1[prev]`` is what the confidence head reads, for every variant. Each bias is
    ``bias(z) = markov_w2(z)`` of a rank-r input ``z`` (:meth:`step_input`, :meth:`block_input`),
    so a loss can apply the N-wide output layer to the supervised slots only.
    """

    head_type = "vanilla"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int | None = None, out_size: int | None = None):
        # vocab_size: rows of markov_w1 (previous tokens are target ids); out_size: width of the bias
        # (the draft vocabulary N; default vocab_size)
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size if out_size is None else out_size, bias=False)

    def features(self, prev_ids: Tensor) -> Tensor:
        return self.markov_w1(prev_ids.long())

    def bias(self, z: Tensor) -> Tensor:
        """The logit bias ``[..., N]`` of rank-r inputs ``z`` ``[..., r]``."""
        return self.markov_w2(z.to(self.markov_w2.weight.dtype))

    def step_input(self, prev_ids: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """One slot's ``(z, feats, state)``: :meth:`step` before the output layer (vanilla: ``z = feats``)."""
        feats = self.features(prev_ids)
        return feats, feats, state

    def block_input(self, prev_ids_XK: Tensor, hidden_XKD: Tensor) -> tuple[Tensor, Tensor]:
        """A block's ``(z_XKr, feats_XKr)``, teacher-forced: :meth:`block` before the output layer."""
        z, feats, _ = self.step_input(prev_ids_XK, hidden_XKD, None)  # memoryless: every slot at once
        return z, feats

    def step(self, prev_ids: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        z, feats, state = self.step_input(prev_ids, hidden, state)
        return self.bias(z), feats, state

    def block(self, prev_ids_XK: Tensor, hidden_XKD: Tensor) -> tuple[Tensor, Tensor]:
        z, feats = self.block_input(prev_ids_XK, hidden_XKD)
        return self.bias(z), feats


class GatedMarkovHead(MarkovHead):
    """``gated``: the bigram features are scaled per rank component by a learned sigmoid gate read
    from the slot's hidden state and the features themselves (DeepSpec ``GatedMarkovHead``):
    ``g = sigmoid(gate_proj([h_k ; W1[prev]]))``, ``bias = W2 (g * W1[prev])``."""

    head_type = "gated"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__(vocab_size, rank, out_size=out_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step_input(self, prev_ids, hidden, state):
        feats = self.features(prev_ids)
        f = feats.to(hidden.dtype)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, f], dim=-1)))
        return gate * f, feats, state


class RNNMarkovHead(MarkovHead):
    """``rnn``: a GRU-style state carried along the block (DeepSpec ``RNNHead``), so slot k's bias
    depends on all earlier tokens of the block, not only the previous one:
    ``[g ; c ; o] = joint_proj([s_{k-1} ; W1[prev_k] ; h_k])``, ``s_k = sigmoid(g) * s_{k-1} +
    (1 - sigmoid(g)) * tanh(c)``, ``bias_k = W2 tanh(o)``, ``s_0 = 0`` at each block's first slot."""

    head_type = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__(vocab_size, rank, out_size=out_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step_input(self, prev_ids, hidden, state):
        feats = self.features(prev_ids)
        f = feats.to(hidden.dtype)
        if state is None:
            state = f.new_zeros(f.shape)
        joint = torch.cat([state.to(hidden.dtype), f, hidden], dim=-1)
        gate_raw, cand_raw, out_raw = self.joint_proj(joint).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), feats, new_state

    def block_input(self, prev_ids_XK, hidden_XKD):
        state, zs, feats = None, [], []
        for k in range(prev_ids_XK.shape[-1]):
            z, f, state = self.step_input(prev_ids_XK[..., k], hidden_XKD[..., k, :], state)
            zs.append(z)
            feats.append(f)
        return torch.stack(zs, dim=-2), torch.stack(feats, dim=-2)


MARKOV_HEADS = {cls.head_type: cls for cls in (MarkovHead, GatedMarkovHead, RNNMarkovHead)}


class ConfidenceHead(nn.Module):
    """Logit of P(slot accepted | earlier slots accepted) from ``[hidden ; markov_w1[prev]]``."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


def _rope_single(x: Tensor, cos: Tensor, sin: Tensor, rotate_half) -> Tensor:
    """RoPE on one tensor ``[B, h, T, d]`` with cos/sin ``[B|1, T, d]`` (transformers' formula)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DSparkAttention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        fam = c.family_module()
        self._apply_rope = fam.apply_rotary_pos_emb
        self._rotate_half = fam.rotate_half
        self.q_norm, self.k_norm = qk_norms(c)

    def _split(self, x_BTX: Tensor, n_heads: int, norm) -> Tensor:
        return split_heads(x_BTX, n_heads, self.head_dim, norm)

    def context_kv(self, ctx_BTD: Tensor, cos_BTd: Tensor, sin_BTd: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's K/V ``[B, Hk, T, d]`` of context features, RoPE applied (K only)."""
        k = self._split(self.k_proj(ctx_BTD), self.num_kv_heads, self.k_norm)
        v = self._split(self.v_proj(ctx_BTD), self.num_kv_heads, None)
        return _rope_single(k, cos_BTd, sin_BTd, self._rotate_half), v

    def forward(self, h_BQD: Tensor, cos_BQd: Tensor, sin_BQd: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                mask) -> Tensor:
        """Queries from the block slots; keys/values = cat(context, block). ``mask``: None (all
        visible), a dense bool ``[B, 1, Q, T+Q]`` or a flex ``BlockMask``."""
        B, Q, _ = h_BQD.shape
        q = self._split(self.q_proj(h_BQD), self.num_heads, self.q_norm)
        k_blk = self._split(self.k_proj(h_BQD), self.num_kv_heads, self.k_norm)
        v_blk = self._split(self.v_proj(h_BQD), self.num_kv_heads, None)
        q, k_blk = self._apply_rope(q, k_blk, cos_BQd, sin_BQd)
        if ctx_k.shape[0] != B:
            ctx_k, ctx_v = ctx_k.expand(B, -1, -1, -1), ctx_v.expand(B, -1, -1, -1)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        gqa = self.num_heads != self.num_kv_heads
        if mask is not None and not isinstance(mask, Tensor):  # flex BlockMask (CUDA)
            # eager flex on the CPU: forward only, used by tests of this path
            out = flex_block_attention(q, k, v, mask, enable_gqa=gqa, compiled=q.is_cuda)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig, hf_config):
        super().__init__()
        Norm = config.family_class("RMSNorm")
        self.self_attn = DSparkAttention(config)
        self.mlp = config.family_class("MLP")(hf_config)
        self.input_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h_BQD, cos_BQd, sin_BQd, ctx_k, ctx_v, mask) -> Tensor:
        h_BQD = h_BQD + self.self_attn(self.input_layernorm(h_BQD), cos_BQd, sin_BQd, ctx_k, ctx_v, mask)
        return h_BQD + self.mlp(self.post_attention_layernorm(h_BQD))


class DSparkDraftModel(DraftVocabMixin, nn.Module):
    """DSpark draft (DFlash when both heads are off). See the module docstring for the layout."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        c = config
        hf = c.to_hf_config()
        Norm = c.family_class("RMSNorm")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.feature_width, c.hidden_size, bias=False)
        self.hidden_norm = Norm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkDecoderLayer(c, hf) for _ in range(c.num_draft_layers)])
        self.norm = Norm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = c.rotary_embedding(hf)
        self.lm_head = nn.Linear(c.hidden_size, c.output_vocab_size, bias=False)
        self.markov_head = (MARKOV_HEADS[c.markov_head_type](c.vocab_size, c.markov_rank, c.hidden_size,
                                                             out_size=c.output_vocab_size)
                            if c.use_markov_head else None)
        self._init_draft_vocab(c)
        self.confidence_head = ConfidenceHead(c.hidden_size + c.markov_dim) if c.use_confidence_head else None
        # the head's held-out calibration (deepspec.models.calibration), saved beside config.json; None: raw
        self.confidence_calibration: ConfidenceCalibration | None = None
        self._init_weights()
        self.freeze_embeddings()

    # ------------------------------------------------------------------ construction
    def _init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
        if self.markov_head is not None:
            # W2 = 0: the head starts as "no bias". W1 rows get unit-variance entries (torch's own
            # nn.Embedding init) so that W2's updates move the bigram bias at a useful rate; with
            # std 0.02 a short run can never grow the bias to the size of real logits.
            nn.init.zeros_(self.markov_head.markov_w2.weight)
            nn.init.normal_(self.markov_head.markov_w1.weight, std=1.0)

    def freeze_embeddings(self) -> None:
        """embed_tokens and lm_head are copies of the target's and never trained (docs/design/draft-models.md)."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_target(cls, target_model: nn.Module, config: DraftConfig, *,
                    d2t: Tensor | None = None) -> DSparkDraftModel:
        """New draft with ``embed_tokens`` / ``lm_head`` copied (not shared) from the target, frozen.
        Tied targets (SmolLM2) copy the same matrix into both.

        ``d2t``: int ``[N]`` draft -> target ids (:func:`deepspec.models.vocab.select_draft_vocab`),
        required exactly when ``config.draft_vocab_size`` is set; ``lm_head`` then holds those rows
        (:func:`draft_from_target`, which lists the errors).
        """
        return draft_from_target(cls, target_model, config, d2t, "draft_config_from_target")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ shared pieces
    def context_features(self, target_hidden_BSF: Tensor) -> Tensor:
        """``hidden_norm(fc(features))`` ``[B, S, D]``."""
        return self.hidden_norm(self.fc(target_hidden_BSF.to(self.fc.weight.dtype)))

    def _rope(self, like: Tensor, pos_BT: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary_emb(like, pos_BT)

    def heads(self, hidden_XKD: Tensor, prev_ids_XK: Tensor) -> tuple[Tensor, Tensor | None]:
        """Final hidden of a block (or a batch of blocks) ``[..., K, D]`` and the (target) tokens before
        each slot ``[..., K]`` -> (logits over draft ids incl. the Markov bias ``[..., K, N]``, confidence logits
        ``[..., K]`` | None), teacher-forced (every Markov variant via ``markov_head.block``)."""
        z, feats = self.markov_inputs(hidden_XKD, prev_ids_XK)
        return self.head_logits(hidden_XKD, z), self._confidence(hidden_XKD, feats)

    def markov_inputs(self, hidden_XKD: Tensor, prev_ids_XK: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """A block's Markov ``(z_XKr, feats_XKr)`` (:meth:`MarkovHead.block_input`); ``(None, None)``
        without a Markov head."""
        if self.markov_head is None:
            return None, None
        return self.markov_head.block_input(prev_ids_XK, hidden_XKD)

    def head_logits(self, hidden_XD: Tensor, markov_input_Xr: Tensor | None) -> Tensor:
        """Logits over the N draft ids ``[..., N]`` of final hidden states ``[..., D]``: ``lm_head``
        plus the Markov bias of its rank-r inputs ``[..., r]`` (None: no Markov head). Under an autocast the
        frozen ``lm_head`` is read in its dtype (:meth:`frozen_as`: cast once, not on every call)."""
        w = self.lm_head.weight
        if torch.is_autocast_enabled(w.device.type):
            w = self.frozen_as(w, torch.get_autocast_dtype(w.device.type))
        logits = F.linear(hidden_XD, w)
        if markov_input_Xr is not None:
            logits = logits + self.markov_head.bias(markov_input_Xr).to(logits.dtype)
        return logits

    def _confidence(self, hidden: Tensor, feats: Tensor | None) -> Tensor | None:
        """Confidence logits ``[...]`` of final hidden states ``[..., D]``: the head reads ``[hidden ; feats]``
        (``feats = markov_w1[prev]`` ``[..., r]``), or ``hidden`` alone without a Markov head or with
        ``config.confidence_head_with_markov`` false; None without a confidence head."""
        if self.confidence_head is None:
            return None
        with_feats = feats is not None and self.config.confidence_head_with_markov
        x = torch.cat([hidden, feats.to(hidden.dtype)], dim=-1) if with_feats else hidden
        return self.confidence_head(x)

    def slot_step(self, hidden_D: Tensor, base_logits_V: Tensor, prev_id: Tensor,
                  state: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One serial drafting slot (inference): ``(logits fp32 over the N draft ids incl. the Markov
        bias, confidence logit | None, Markov state)``. ``prev_id``: the *target* id before the slot, ``[1]``;
        ``state``: ``None`` at slot 0, then the returned one. K calls with the drafted tokens equal
        :meth:`heads` on the block."""
        logits_V = base_logits_V.float()  # no copy when the caller passes fp32 (DSparkProposer does, once per block)
        feats = None
        if self.markov_head is not None:
            bias_1V, feats_1r, state = self.markov_head.step(prev_id.view(1), hidden_D.unsqueeze(0), state)
            logits_V = logits_V + bias_1V[0]  # fp32 + (bf16 | fp32) adds in fp32: the same sum, no fp32 copy of the bias
            feats = feats_1r[0]
        return logits_V, self._confidence(hidden_D, feats), state

    def slot_logits(self, hidden_D: Tensor, base_logits_V: Tensor, prev_ids_X: Tensor,
                    state_X: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """:meth:`slot_step` for X candidates of one slot at once (a draft tree's nodes, which share the
        slot's hidden state): ``(logits fp32 [X, N], Markov state [X, ...] | None)``; no confidence.
        ``prev_ids_X``: each candidate's previous *target* id; ``state_X``: None at slot 0."""
        logits_XV = base_logits_V.float().expand(prev_ids_X.shape[0], -1)
        if self.markov_head is None:
            return logits_XV, state_X
        hidden_XD = hidden_D.unsqueeze(0).expand(prev_ids_X.shape[0], -1)
        bias_XV, _, state_X = self.markov_head.step(prev_ids_X, hidden_XD, state_X)
        return logits_XV + bias_XV, state_X

    # ------------------------------------------------------------------ training forward
    def forward_train(self, input_ids_BS: Tensor, target_hidden_BSF: Tensor, anchor_pos_BA: Tensor,
                      block_valid_BA: Tensor, *, use_flex: bool | None = None,
                      defer_logits: bool = False) -> DraftTrainOutput:
        """Block-parallel forward over all anchors (docs/design/draft-models.md, "Block layout").

        Args:
            input_ids_BS: int ``[B, S]``; target_hidden_BSF: ``[B, S, F]``;
            anchor_pos_BA: int64 ``[B, A]``; block_valid_BA: bool ``[B, A]`` (from sample_anchors).
            use_flex: flex_attention BlockMask (default: on CUDA) instead of a dense SDPA mask.
            defer_logits: return no ``logits_BAKV``, only what computes them (:class:`DraftTrainOutput`).
        Returns:
            DraftTrainOutput over the block's ``J = config.num_draft_slots`` draft slots (all K, or the
            K-1 mask slots of z-lab's layout; draft slot j predicts ``x_{a+j+1}`` either way):
            logits_BAKV ``[B, A, J, N]`` (with Markov bias from the true previous tokens
            ``[x_a .. x_{a+J-1}]``, gathered indices clamped at S-1), confidence_logits_BAK | None,
            hidden_BAKD ``[B, A, J, D]``.
        """
        c = self.config
        K = c.block_size
        B, S = input_ids_BS.shape
        A = anchor_pos_BA.shape[1]
        dev = input_ids_BS.device
        anchor_pos_BA = anchor_pos_BA.to(dev).long()
        block_valid_BA = block_valid_BA.to(dev).bool()
        offs_K = torch.arange(K, device=dev)
        # prev tokens per slot: x_{a+k}; slot 0's is the anchor token itself.
        prev_pos_BAK = (anchor_pos_BA.unsqueeze(-1) + offs_K).clamp(max=S - 1)
        prev_ids_BAK = torch.gather(input_ids_BS.long(), 1, prev_pos_BAK.view(B, -1)).view(B, A, K)
        block_ids_BAK = torch.full_like(prev_ids_BAK, c.mask_token_id)
        block_ids_BAK[:, :, 0] = prev_ids_BAK[:, :, 0]

        ctx_BSD = self.context_features(target_hidden_BSF)
        h_BQD = self.embed(block_ids_BAK.view(B, A * K)).to(ctx_BSD.dtype)
        pos_ctx_1S = torch.arange(S, device=dev).unsqueeze(0)
        pos_blk_BQ = (anchor_pos_BA.unsqueeze(-1) + offs_K).view(B, A * K)
        cos_ctx, sin_ctx = self._rope(h_BQD, pos_ctx_1S)
        cos_blk, sin_blk = self._rope(h_BQD, pos_blk_BQ)
        if use_flex is None:
            use_flex = dev.type == "cuda"
        if use_flex:
            mask = flex_block_mask(anchor_pos_BA, block_valid_BA, S, K, device=dev, pad_to_blocks=True)
        else:
            mask = dense_block_mask(anchor_pos_BA, block_valid_BA, S, K)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx_BSD, cos_ctx, sin_ctx)
            h_BQD = layer(h_BQD, cos_blk, sin_blk, ctx_k, ctx_v, mask)
        J = c.num_draft_slots  # the slots that propose: all K, or the K-1 mask slots (z-lab's layout)
        hidden_BAKD = self.norm(h_BQD).view(B, A, K, -1)[:, :, c.first_draft_slot:]
        z_BAKr, feats_BAKr = self.markov_inputs(hidden_BAKD, prev_ids_BAK[:, :, :J])
        return DraftTrainOutput(logits_BAKV=None if defer_logits else self.head_logits(hidden_BAKD, z_BAKr),
                                confidence_logits_BAK=self._confidence(hidden_BAKD, feats_BAKr),
                                hidden_BAKD=hidden_BAKD, markov_input_BAKr=z_BAKr,
                                head_logits=self.head_logits if defer_logits else None)

    # ------------------------------------------------------------------ inference API
    def new_context_cache(self) -> DraftContextCache:
        return DraftContextCache()

    def check_context_features(self, target_hidden_TF: Tensor, where: str) -> None:
        """Raise ValueError (naming ``where``) unless ``target_hidden_TF`` is ``[T, feature_width]``."""
        if target_hidden_TF.dim() != 2 or target_hidden_TF.shape[-1] != self.config.feature_width:
            raise ValueError(f"{where}: expected target_hidden_TF of shape [T, {self.config.feature_width}], "
                             f"received {tuple(target_hidden_TF.shape)}.")

    @torch.no_grad()
    def append_context(self, cache: DraftContextCache, target_hidden_TF: Tensor) -> None:
        """Append features of the next committed positions (``cache.length ..``) to every layer's K/V."""
        self.check_context_features(target_hidden_TF, "append_context")
        T = target_hidden_TF.shape[0]
        if T == 0:
            return
        dev = self.fc.weight.device
        ctx_1TD = self.context_features(target_hidden_TF.to(dev).unsqueeze(0))
        pos_1T = torch.arange(cache.length, cache.length + T, device=dev).unsqueeze(0)
        cos, sin = self._rope(ctx_1TD, pos_1T)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx_1TD, cos, sin)
            if i < len(cache.k):
                cache.k[i] = torch.cat([cache.k[i], k], dim=2)
                cache.v[i] = torch.cat([cache.v[i], v], dim=2)
            else:
                cache.k.append(k)
                cache.v.append(v)
        cache.length += T

    @torch.no_grad()
    def block_hidden(self, cache: DraftContextCache, anchor_token: int, anchor_pos: int,
                     num_slots: int | None = None) -> tuple[Tensor, Tensor]:
        """Run ``[anchor, m, .., m]`` at positions ``anchor_pos .. anchor_pos+K-1`` attending to all
        cached context (which must hold exactly positions ``0..anchor_pos-1``) and to the whole block.

        Returns (final hidden of the block's draft slots ``[J, D]``, base logits ``[S, N]`` over draft
        ids for the first ``S = num_slots`` of them (None: all J), without the Markov bias). The draft
        slots are ``config.first_draft_slot ..`` (J = ``config.num_draft_slots``: all K slots, or the K-1
        mask slots of z-lab's layout). The whole block runs through the layers either way (every slot
        attends to the others); only the output layer, the costliest product of a proposal, is cut to
        the slots a capped proposal uses.
        """
        if cache.length != anchor_pos:
            raise ValueError(f"block_hidden: expected the context cache to hold positions 0..anchor_pos-1 "
                             f"(length {anchor_pos}), received length {cache.length}. Append/crop the context first.")
        c = self.config
        K = c.block_size
        dev = self.fc.weight.device
        ids_1K = torch.full((1, K), c.mask_token_id, dtype=torch.long, device=dev)
        ids_1K[0, 0] = int(anchor_token)
        h = self.embed(ids_1K).to(self.fc.weight.dtype)
        cos, sin = self._rope(h, torch.arange(anchor_pos, anchor_pos + K, device=dev).unsqueeze(0))
        for i, layer in enumerate(self.layers):
            if cache.length:
                ctx_k, ctx_v = cache.k[i], cache.v[i]
            else:
                empty = h.new_zeros(1, c.num_key_value_heads, 0, c.head_dim)
                ctx_k, ctx_v = empty, empty
            h = layer(h, cos, sin, ctx_k, ctx_v, None)
        hidden_JD = self.norm(h)[0, c.first_draft_slot:]
        return hidden_JD, self.lm_head(hidden_JD if num_slots is None else hidden_JD[:num_slots])

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``model.safetensors`` (all weights incl. frozen embed/lm_head: self-contained, as the
        original) and ``config.json`` (DraftConfig + ``architectures`` + ``deepspec_algorithm``, and
        ``layer_types``: the draft layers' own attention, always ``full_attention``, whatever sliding
        windows the target has), atomically as a folder; with a :attr:`confidence_calibration`, also its
        ``confidence_calibration.json``."""

        # deepspec_algorithm: the registry's name (deepspec.algorithms.registry.algorithm_of_draft); DFlash is
        # this model with both heads off.
        heads = self.config.use_markov_head or self.config.use_confidence_head
        cfg = {"architectures": [self.config.architecture], "model_type": "dspark",
               "deepspec_algorithm": "dspark" if heads else "dflash",
               "layer_types": ["full_attention"] * self.config.num_draft_layers, "draft_config": self.config.to_dict()}
        cal = self.confidence_calibration
        return save_draft_folder(out_dir, self.state_dict(), cfg,
                                 None if cal is None else {CALIBRATION_NAME: cal.to_dict()})

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> DSparkDraftModel:
        """Load a folder written by :meth:`save_pretrained` (strict: every weight must match), with its
        confidence calibration when the folder has one (:func:`deepspec.models.calibration.load_calibration`)."""
        path = Path(path)
        weights = load_draft_weights(path, CONFIG_NAME, WEIGHTS_NAME, "DSparkDraftModel.from_pretrained")
        cfg = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
        config = DraftConfig.from_dict(cfg["draft_config"])
        model = cls(config)
        state = check_saved_d2t(weights, config, str(path / WEIGHTS_NAME))
        model.load_state_dict(state, strict=True)
        model.freeze_embeddings()
        if config.use_confidence_head:
            model.confidence_calibration = load_calibration(path)
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
