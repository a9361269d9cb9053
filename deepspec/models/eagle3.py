"""Eagle3 draft model, its training-time-test (TTT) loss and its algorithm entry.

Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test" (2025).

Legend: B batch, S sequence length, H hidden (= target hidden), F = n_layers * H target feature
width, V target vocab, W draft vocab (= V unless ``draft_vocab_size`` reduces it), K ttt_steps (unrolled steps = tokens drafted per proposal), T a run of rows,
Hq query heads, Hk KV heads, d head_dim, N supervised rows of one step.

Architecture (parameter names follow the original Eagle3 checkpoints where they exist):
  embed_tokens (frozen copy of the target's), fc (Linear F -> H, no bias: fuses the target
  features of all cached layers), midlayer = one decoder layer of the target's family whose
  attention projections read ``cat(input_layernorm(embed(token)), hidden_norm(hidden))`` (2H ->
  q/k/v), with the residual taken from ``hidden``; post_attention_layernorm + the family's MLP;
  norm (final), lm_head (frozen copy of the target's: all V rows, or the rows ``d2t`` of a reduced
  draft vocabulary, ``[W, H]``), and with a reduced vocabulary the buffer ``d2t`` (int64 ``[W]``,
  absolute target ids; :mod:`deepspec.models.vocab`; EAGLE-3's own checkpoints store offsets).

Rows. Row ``t`` of a sequence pairs the fused target feature ``f_t`` (position t) with the *next*
token ``x_{t+1}`` and predicts ``x_{t+2}``. TTT step ``k`` (0 <= k < K) at row ``t`` reads the
token ``x_{t+1+k}`` and, instead of ``f_t``, the draft's own pre-norm output of step ``k-1`` at row
``t`` (step 0 reads ``fc(f_t)``); it predicts ``x_{t+k+2}``. Its RoPE position is ``t + k``.

Attention at step k (the Eagle3 trick): row ``t`` attends to the step-0 keys of rows ``0..t``
(causal) and to its own keys of steps ``1..k`` (the diagonal of each later step). This is exactly
what chain drafting sees at inference: the committed rows (step 0, from target features) plus the
chain's own earlier steps. Implemented with dense SDPA over ``cat(K_0, .., K_k)`` and a bool mask.

Loss (soft cross-entropy against the target): row t at step k is supervised iff
``t + k + 2 < S`` and ``loss_mask[t + k + 2]``; its target is
``softmax(lm_head(target_last_hidden[t + k + 1]))``; weight ``decay^k`` (0.8). The micro-batch's
loss is ``sum_k decay^k sum_rows CE / weight_sum`` with ``weight_sum`` the global batch's total
supervision weight (the protocol's ``weight``), so padding and micro-batching do not change it.

Reduced draft vocabulary: the draft's logits are over its W tokens; the soft CE is
``-sum_{d < W} p_t[d2t[d]] log p_d[d]`` with ``p_t`` the target's full-vocabulary softmax (not
renormalised): the target mass outside the draft vocabulary contributes nothing it could learn, and
the row stays in the normaliser (as DSpark's CE with a label outside the vocabulary; EAGLE-3 instead
renormalises ``p_t`` over the draft tokens and drops rows whose target argmax is outside them). The
minimiser is the same, ``p_d`` proportional to ``p_t`` on the draft tokens. Accuracy compares
``d2t[argmax p_d]`` with the target argmax over V.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspec.eval.proposers import Proposal, draw_token
from deepspec.models.acceptance import AcceptanceCounts, chain_acceptance
from deepspec.models.config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    TargetShapeConfig,
    config_from_dict,
    save_draft_folder,
    target_shape_fields,
)
from deepspec.models.draft_common import DraftVocabMixin, check_saved_d2t, draft_from_target, qk_norms, split_heads
from deepspec.models.vocab import scatter_to_target
from deepspec.target.decoding import SamplingParams

ALGORITHM_NAME = "eagle3"


# ----------------------------------------------------------------------------------------------- config


@dataclass(kw_only=True)
class Eagle3Config(TargetShapeConfig):
    """Shape (copied from the target, as for DSpark: :class:`TargetShapeConfig`) and TTT knobs of an
    Eagle3 draft."""

    ttt_steps: int = 7  # unrolled training steps = tokens drafted per proposal
    step_decay: float = 0.8  # weight of TTT step k is step_decay ** k

    # step_decay is a loss weight (training only); see config_from_dict.
    OPTIONAL_ON_LOAD: ClassVar[tuple[str, ...]] = TargetShapeConfig.OPTIONAL_ON_LOAD + ("step_decay",)

    # Eagle3 has no mask token. The trainer checks ``config.mask_token_id`` against the data; -1 never
    # occurs there, so the check is a no-op for Eagle3.
    mask_token_id: int = dataclasses.field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()  # the shape fields (family, heads, layer ids, ...)
        if not isinstance(self.ttt_steps, int) or isinstance(self.ttt_steps, bool) or self.ttt_steps < 1:
            raise ValueError(f"Eagle3Config.ttt_steps: expected an integer >= 1, received {self.ttt_steps!r}. "
                             "The original uses 7.")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"Eagle3Config.step_decay: expected a value in (0, 1], received {self.step_decay!r}. "
                             "The original uses 0.8.")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("mask_token_id")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_dict` (:func:`~deepspec.models.config.config_from_dict`: unknown keys
        and missing forward-pass keys raise ValueError naming them)."""
        return config_from_dict(cls, d)


def eagle3_config_from_target(target_config: Any, *, target_layer_ids: list[int], ttt_steps: int = 7,
                              step_decay: float = 0.8, pad_token_id: int | None = None,
                              eos_token_id: list[int] | int | None = None,
                              draft_vocab_size: int | None = None) -> Eagle3Config:
    """Derive an :class:`Eagle3Config` from a transformers target config (same family rules as DSpark's
    :func:`deepspec.models.config.draft_config_from_target`)."""
    return Eagle3Config(**target_shape_fields(target_config, target_layer_ids=target_layer_ids,
                                              pad_token_id=pad_token_id, eos_token_id=eos_token_id),
                        ttt_steps=ttt_steps, step_decay=step_decay, draft_vocab_size=draft_vocab_size)


# ----------------------------------------------------------------------------------------------- model


@dataclass
class Eagle3Cache:
    """Inference K/V of committed rows (step 0, from target features): ``k``/``v`` ``[1, Hk, T, d]``
    (RoPE applied to K at positions ``0..T-1``); ``length`` = committed rows."""

    k: Tensor | None = None
    v: Tensor | None = None
    length: int = 0

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"Eagle3Cache.crop: expected 0 <= n <= length={self.length}, received {n}.")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
        self.length = n


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v projections read the 2H input ``[embed ; hidden]``."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self._apply_rope = c.family_module().apply_rotary_pos_emb
        self.q_norm, self.k_norm = qk_norms(c)

    def _split(self, x: Tensor, n_heads: int, norm) -> Tensor:
        return split_heads(x, n_heads, self.head_dim, norm)

    def forward(self, x_BT2: Tensor, cos: Tensor, sin: Tensor, prev_k: Tensor | None, prev_v: Tensor | None,
                mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries/keys/values of the T new rows; attend to ``cat(prev, new)`` under ``mask`` (bool
        ``[.., T, P+T]``, True = visible; None = everything visible). Returns (out ``[B, T, H]``,
        new K (RoPE'd), new V), both ``[B, Hk, T, d]``."""
        B, T, _ = x_BT2.shape
        q = self._split(self.q_proj(x_BT2), self.num_heads, self.q_norm)
        k = self._split(self.k_proj(x_BT2), self.num_kv_heads, self.k_norm)
        v = self._split(self.v_proj(x_BT2), self.num_kv_heads, None)
        q, k = self._apply_rope(q, k, cos, sin)
        k_all = k if prev_k is None else torch.cat([prev_k.expand(B, -1, -1, -1), k], dim=2)
        v_all = v if prev_v is None else torch.cat([prev_v.expand(B, -1, -1, -1), v], dim=2)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)), k, v


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3Config, hf_config):
        super().__init__()
        Norm = c.family_class("RMSNorm")
        self.self_attn = Eagle3Attention(c)
        self.mlp = c.family_class("MLP")(hf_config)
        self.input_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = Norm(c.hidden_size, eps=c.rms_norm_eps)  # on the fused feature / previous hidden
        self.post_attention_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, emb_BTH: Tensor, hid_BTH: Tensor, cos, sin, prev_k, prev_v, mask):
        x = torch.cat([self.input_layernorm(emb_BTH), self.hidden_norm(hid_BTH)], dim=-1)
        attn, k, v = self.self_attn(x, cos, sin, prev_k, prev_v, mask)
        h = hid_BTH + attn
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


def ttt_masks(S: int, steps: int, device=None) -> list[Tensor]:
    """Bool masks ``[S, S*(k+1)]`` per step k: causal over step 0's keys, diagonal over steps 1..k."""
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=device)
    return [torch.cat([causal] + [eye] * k, dim=1) for k in range(steps)]


class Eagle3DraftModel(DraftVocabMixin, nn.Module):
    """Eagle3 drafter (see the module docstring)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = c = config
        hf = c.to_hf_config()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.feature_width, c.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(c, hf)
        self.norm = c.family_class("RMSNorm")(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = c.family_class("RotaryEmbedding")(hf)
        self.lm_head = nn.Linear(c.hidden_size, c.output_vocab_size, bias=False)
        self._init_draft_vocab(c)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        self.freeze_embeddings()

    def freeze_embeddings(self) -> None:
        """embed_tokens and lm_head are copies of the target's and never trained (as DSpark's)."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_target(cls, target_model: nn.Module, config: Eagle3Config, *,
                    d2t: Tensor | None = None) -> Eagle3DraftModel:
        """New draft with the target's embedding / lm_head copied (frozen); ``d2t`` as for DSpark
        (:func:`deepspec.models.draft_common.draft_from_target`)."""
        return draft_from_target(cls, target_model, config, d2t, "eagle3_config_from_target")

    # ------------------------------------------------------------------ training forward
    def forward_train(self, input_ids_BS: Tensor, target_hidden_BSF: Tensor,
                      steps: int | None = None) -> list[Tensor]:
        """The K unrolled TTT steps; returns the pre-norm hidden states ``[B, S, H]`` of each step
        (row t of step k predicts ``x_{t+k+2}``; rows whose inputs run past S are garbage, never
        supervised, and never seen by supervised rows)."""
        K = self.config.ttt_steps if steps is None else steps
        B, S = input_ids_BS.shape
        dev = input_ids_BS.device
        ids = input_ids_BS.long()
        hid = self.fc(target_hidden_BSF.to(self.fc.weight.dtype))
        masks = ttt_masks(S, K, dev)
        ks: list[Tensor] = []
        vs: list[Tensor] = []
        outs = []
        for k in range(K):
            # token of row t at step k: x_{t+1+k} (past the end: token 0, an unsupervised row)
            tok = torch.zeros_like(ids)
            if k + 1 < S:
                tok[:, : S - 1 - k] = ids[:, k + 1:]
            emb = self.embed_tokens(tok).to(hid.dtype)
            cos, sin = self.rotary_emb(hid, (torch.arange(S, device=dev) + k).unsqueeze(0))
            prev_k = torch.cat(ks, dim=2) if ks else None
            prev_v = torch.cat(vs, dim=2) if vs else None
            hid, kk, vv = self.midlayer(emb, hid, cos, sin, prev_k, prev_v, masks[k])
            ks.append(kk)
            vs.append(vv)
            outs.append(hid)
        return outs

    # ------------------------------------------------------------------ inference
    def new_cache(self) -> Eagle3Cache:
        return Eagle3Cache()

    @torch.no_grad()
    def commit_rows(self, cache: Eagle3Cache, next_token_ids_T: Tensor, target_hidden_TF: Tensor) -> Tensor:
        """Append rows ``cache.length ..`` (feature ``f_t`` with next token ``x_{t+1}``) at step 0,
        attending to every committed row and causally among themselves. Returns their pre-norm
        outputs ``[T, H]`` (the last one starts a chain)."""
        T = int(next_token_ids_T.shape[0])
        dev = self.fc.weight.device
        hid = self.fc(target_hidden_TF.to(dev, self.fc.weight.dtype)).unsqueeze(0)
        emb = self.embed_tokens(next_token_ids_T.to(dev).long().view(1, T)).to(hid.dtype)
        L = cache.length
        cos, sin = self.rotary_emb(hid, torch.arange(L, L + T, device=dev).unsqueeze(0))
        mask = torch.ones(T, L + T, dtype=torch.bool, device=dev)
        mask[:, L:] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        out, k, v = self.midlayer(emb, hid, cos, sin, cache.k, cache.v, mask)
        cache.k = k if cache.k is None else torch.cat([cache.k, k], dim=2)
        cache.v = v if cache.v is None else torch.cat([cache.v, v], dim=2)
        cache.length += T
        return out[0]

    @torch.no_grad()
    def chain_step(self, cache: Eagle3Cache, chain_k: list[Tensor], chain_v: list[Tensor], token_id: Tensor,
                   hidden_H: Tensor, pos: int) -> Tensor:
        """One chain step k >= 1 at RoPE position ``pos``: input (token, previous step's hidden),
        attending to all committed rows and the chain's earlier steps; appends its K/V to the chain
        lists. Returns the pre-norm output ``[H]``."""
        dev = self.fc.weight.device
        hid = hidden_H.view(1, 1, -1)
        emb = self.embed_tokens(token_id.to(dev).long().view(1, 1)).to(hid.dtype)
        cos, sin = self.rotary_emb(hid, torch.tensor([[pos]], device=dev))
        prev_k = torch.cat([cache.k, *chain_k], dim=2)
        prev_v = torch.cat([cache.v, *chain_v], dim=2)
        out, k, v = self.midlayer(emb, hid, cos, sin, prev_k, prev_v, None)
        chain_k.append(k)
        chain_v.append(v)
        return out[0, 0]

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft's W tokens (draft ids; ``target_ids`` maps them)."""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """``model.safetensors`` (all weights, self-contained) + ``config.json`` with
        ``deepspec_algorithm: eagle3``, written atomically as a folder."""

        cfg = {"architectures": ["Eagle3DraftModel"], "model_type": "eagle3", "deepspec_algorithm": ALGORITHM_NAME,
               "eagle3_config": self.config.to_dict()}
        return save_draft_folder(out_dir, self.state_dict(), cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu") -> Eagle3DraftModel:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"Eagle3DraftModel.from_pretrained: expected {path}/{CONFIG_NAME} and "
                                    f"{path}/{WEIGHTS_NAME}; pass a folder written by save_pretrained().")
        cfg = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
        if cfg.get("deepspec_algorithm") != ALGORITHM_NAME:
            raise ValueError(f"Eagle3DraftModel.from_pretrained: {path} holds a "
                             f"{cfg.get('deepspec_algorithm', 'dspark/dflash')!r} draft, not an Eagle3 one.")
        config = Eagle3Config.from_dict(cfg["eagle3_config"])
        model = cls(config)
        model.load_state_dict(check_saved_d2t(load_file(str(path / WEIGHTS_NAME)), config, str(path / WEIGHTS_NAME)),
                              strict=True)
        model.freeze_embeddings()
        return model.to(device)


# ----------------------------------------------------------------------------------------------- loss


def ttt_supervision(loss_mask_BS: Tensor, steps: int, decay: float,
                    rows_BS: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(valid_KBS bool, weight_KBS float32)``: row t of step k is supervised iff ``t+k+2 < S`` and
    ``loss_mask[t+k+2]`` (and, if ``rows_BS`` is given, ``rows_BS[t]``: only sampled chains); its
    weight is ``decay**k``."""
    B, S = loss_mask_BS.shape
    lm = loss_mask_BS.bool()
    valid = torch.zeros(steps, B, S, dtype=torch.bool, device=lm.device)
    for k in range(steps):
        if k + 2 < S:
            valid[k, :, : S - k - 2] = lm[:, k + 2:]
    if rows_BS is not None:
        valid &= rows_BS.bool().to(valid.device)[None]
    w = valid.float() * (decay ** torch.arange(steps, dtype=torch.float32, device=lm.device)).view(steps, 1, 1)
    return valid, w


@dataclass
class _Eagle3MicroBatch:
    batch: Any  # deepspec.train.data.TrainBatch
    rows_BS: Tensor | None  # bool: chain starts supervised this step (None = all)


@dataclass
class Eagle3LossOutput:
    """``loss`` carries the graph. ``acc_K``: fraction of this micro-batch's supervised rows at step
    k where argmax(draft) == argmax(target) (teacher-forced greedy acceptance of slot k).
    ``acceptance``: the chains' additive acceptance counts (:mod:`deepspec.models.acceptance`, one
    chain per start row); the trainer sums them over the global batch and ranks before taking the
    tau estimates."""

    loss: Tensor
    weight_sum: Tensor
    local_weight_sum: Tensor
    num_supervised_K: list[int]
    acc_K: list[float]
    acceptance: AcceptanceCounts

    @property
    def tau_estimate(self) -> float:
        return self.acceptance.tau()

    @property
    def greedy_tau_estimate(self) -> float:
        return self.acceptance.greedy_tau()

    def scalars(self) -> dict[str, float]:
        return {"loss": float(self.loss.detach()), "num_supervised": float(sum(self.num_supervised_K))}


def _soft_ce_chunk(hidden_NH: Tensor, target_hidden_NH: Tensor, w_N: Tensor, final_norm: nn.Module,
                   lm_w: Tensor, target_lm_w: Tensor, d2t_W: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted soft-CE sum of a chunk, and (detached) argmax matches and T = 1 acceptance
    probabilities ``1 - TV`` (in target id space); recomputed in backward. ``lm_w`` ``[W, H]``: the
    draft's output rows; ``target_lm_w`` ``[V, H]``: the target's."""
    logits_NW = F.linear(final_norm(hidden_NH), lm_w).float()
    logp_NW = F.log_softmax(logits_NW, dim=-1)
    with torch.no_grad():
        tlogits_NV = F.linear(target_hidden_NH.to(target_lm_w.dtype), target_lm_w).float()
        tprob_NV = torch.softmax(tlogits_NV, dim=-1)
        drafted_N = logits_NW.argmax(-1)
        if d2t_W is None:
            tprob_NW = tprob_NV
        else:
            tprob_NW, drafted_N = tprob_NV[:, d2t_W], d2t_W[drafted_N]
        match = (drafted_N == tlogits_NV.argmax(-1)).float()
        # L1 over V: the draft tokens, plus the target's mass outside the draft vocabulary (0 when W = V)
        l1_N = (logp_NW.exp() - tprob_NW).abs().sum(-1) + (1.0 - tprob_NW.sum(-1)).clamp_min(0.0)
        accept = (1.0 - 0.5 * l1_N).clamp(0.0, 1.0)
    ce = -(tprob_NW * logp_NW).sum(-1)
    return (w_N * ce).sum(), match, accept


def eagle3_loss(model: Eagle3DraftModel, input_ids_BS: Tensor, loss_mask_BS: Tensor, target_hidden_BSF: Tensor,
                target_last_hidden_BSH: Tensor, *, weight_sum: Tensor | float | None = None,
                autocast: Any = None, chunk_rows: int = 1024, rows_BS: Tensor | None = None) -> Eagle3LossOutput:
    """TTT loss of one micro-batch (module docstring). ``weight_sum``: the global batch's
    :func:`ttt_supervision` weight sum (None = this micro-batch's own). ``rows_BS``: supervise only
    the chains starting at these rows (None = every row). Only supervised rows are
    projected to the vocabulary, in checkpointed chunks of ``chunk_rows`` (memory ``chunk x V``)."""
    c = model.config
    K = c.ttt_steps
    dev = model.fc.weight.device

    with autocast if autocast is not None else contextlib.nullcontext():
        outs = model.forward_train(input_ids_BS.to(dev), target_hidden_BSF.to(dev))
    valid_KBS, w_KBS = ttt_supervision(loss_mask_BS.to(dev), K, c.step_decay, rows_BS)
    local_ws = w_KBS.sum()
    norm = local_ws if weight_sum is None else torch.as_tensor(weight_sum, dtype=torch.float32, device=dev)
    norm = norm.clamp_min(1e-12)
    loss = sum(o.sum() for o in outs) * 0.0  # keeps the graph when nothing is supervised
    tl = target_last_hidden_BSH.to(dev)
    counts, accs = [], []
    match_KBS = torch.zeros(valid_KBS.shape, dtype=torch.bool, device=dev)
    accept_KBS = torch.zeros(valid_KBS.shape, device=dev)
    for k in range(K):
        b_N, t_N = valid_KBS[k].nonzero(as_tuple=True)
        N = int(b_N.numel())
        counts.append(N)
        if N == 0:
            accs.append(0.0)
            continue
        h_NH = outs[k][b_N, t_N]
        th_NH = tl[b_N, t_N + k + 1]
        w_N = w_KBS[k][b_N, t_N]
        matches, accepts = [], []
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            part, match, accept = checkpoint(_soft_ce_chunk, h_NH[s:e], th_NH[s:e], w_N[s:e], model.norm,
                                             model.lm_head.weight, model.target_lm_head_weight, model.d2t,
                                             use_reentrant=False)
            loss = loss + part / norm
            matches.append(match)
            accepts.append(accept)
        match_KBS[k][b_N, t_N] = torch.cat(matches).bool()
        accept_KBS[k][b_N, t_N] = torch.cat(accepts)
        accs.append(float(torch.cat(matches).mean()))
    # one chain per start row (b, t): its step k is slot k
    acceptance = chain_acceptance(valid_KBS.flatten(1).T, match_KBS.flatten(1).T, accept_KBS.flatten(1).T)
    return Eagle3LossOutput(loss=loss, weight_sum=norm.detach(), local_weight_sum=local_ws.detach(),
                            num_supervised_K=counts, acc_K=accs, acceptance=acceptance)


# ----------------------------------------------------------------------------------------------- algorithm


class Eagle3Algorithm:
    """Eagle3 behind :class:`deepspec.models.registry.DraftAlgorithm`. ``ttt_steps`` comes from
    ``cfg.ttt_steps`` when the trainer's config has it, else ``cfg.block_size`` (the same number of
    drafted tokens per step as DSpark/DFlash, 7 by default)."""

    name = ALGORITHM_NAME

    def build(self, target_model, tokenizer, cfg, target_layer_ids, *, d2t=None):
        if getattr(cfg, "init_from_target", False):
            raise ValueError("train.init_from_target: Eagle3's decoder layer cannot start as a copy of a target layer: "
                             "its q/k/v projections read [embedding ; hidden] (2H inputs, the target's read H), and a "
                             "partial copy would be a different recipe; received init_from_target=True for "
                             "algorithm=eagle3. Drop --init-from-target for eagle3.")
        if getattr(cfg, "num_draft_layers", 1) != 1:
            raise ValueError(f"train.num_draft_layers: Eagle3 has exactly one decoder layer, received "
                             f"{cfg.num_draft_layers}; set num_draft_layers=1 for algorithm=eagle3.")
        steps = getattr(cfg, "ttt_steps", None) or cfg.block_size
        config = eagle3_config_from_target(target_model.config, target_layer_ids=list(target_layer_ids),
                                           ttt_steps=int(steps), pad_token_id=getattr(tokenizer, "pad_token_id", None),
                                           eos_token_id=getattr(tokenizer, "eos_token_id", None),
                                           draft_vocab_size=None if d2t is None else int(d2t.shape[0]))
        return Eagle3DraftModel.from_target(target_model, config, d2t=d2t)

    def load(self, path):
        return Eagle3DraftModel.from_pretrained(path)

    def prepare(self, model, batch, generator, cfg):
        """The batch and the chains to supervise: every row when ``cfg.num_anchors`` is 0, else up to
        ``num_anchors`` chain starts per sequence, drawn uniformly without replacement among rows whose
        step-0 target is supervised (the same supervision budget as DSpark's anchors: ``num_anchors``
        chains/blocks of ``ttt_steps``/``block_size`` predictions). Sampling is an unbiased estimate
        of the all-rows loss; it cuts the vocabulary projections, which dominate a CPU step."""
        num = int(getattr(cfg, "num_anchors", 0) or 0)
        if num <= 0:
            return _Eagle3MicroBatch(batch, None)
        valid0 = ttt_supervision(batch.loss_mask_BS, 1, 1.0)[0][0]  # [B, S]: step-0 target supervised
        rows = torch.zeros_like(valid0)
        for b in range(valid0.shape[0]):
            cand = valid0[b].nonzero(as_tuple=True)[0]
            if cand.numel() > num:
                cand = cand[torch.randperm(cand.numel(), generator=generator)[:num]]
            rows[b, cand] = True
        return _Eagle3MicroBatch(batch, rows)

    def weight(self, model, prepared):
        return ttt_supervision(prepared.batch.loss_mask_BS, model.config.ttt_steps, model.config.step_decay,
                               prepared.rows_BS)[1].sum()

    def loss(self, model, prepared, *, weight_sum, autocast):
        b = prepared.batch
        return eagle3_loss(model, b.input_ids_BS, b.loss_mask_BS, b.target_hidden_BSF, b.target_last_hidden_BSH,
                           weight_sum=weight_sum, autocast=autocast, rows_BS=prepared.rows_BS)

    def proposer(self, model, *, confidence_threshold=None, max_positions=None):
        return Eagle3Proposer(model, max_positions=max_positions)

    def owns(self, model):
        return isinstance(model, Eagle3DraftModel)


# =====================================================================================
# Eagle3Proposer
# =====================================================================================


class Eagle3Proposer:
    """Eagle3 chain drafter behind the :class:`~deepspec.eval.proposers.Proposer` protocol.

    Draft row ``t`` pairs the target feature of position ``t`` with the token at ``t + 1``, so the
    proposer needs the committed *tokens* as well as their features: ``extend_context`` takes
    ``token_ids_T``, the tokens at the same positions as ``target_hidden_TF``. A row enters the draft's KV cache (step 0,
    from target features) once its next token is known; ``propose(anchor_token, anchor_pos)``
    therefore first commits rows ``.. anchor_pos - 1`` (the last one reads the anchor), then drafts
    ``k`` tokens by chaining: step ``j >= 1`` reads the token drafted at step ``j - 1`` and that
    step's own pre-norm hidden state, at RoPE position ``anchor_pos - 1 + j``, attending to every
    committed row and to the chain's earlier steps (the TTT attention rule). Chain K/V are never
    committed: after verify, the accepted positions come back with real target features through
    ``extend_context``, so a rejection needs no crop of the draft's cache.

    ``k`` defaults to the draft's ``ttt_steps``; ``max_positions`` caps drafted positions as in
    :class:`~deepspec.models.dspark.DSparkProposer`. At T = 0 tokens are argmaxes and
    ``draft_probs_NV`` is None; at T > 0 ``sampling_probs(logits, sampling)`` (fp32) is sampled from
    and returned. A reduced draft vocabulary is handled as in DSpark's proposer (draft ids mapped to
    target ids, ``q`` scattered into the full target vocabulary).
    """


    def __init__(self, model, *, k: int | None = None, max_positions: int | None = None):
        if not isinstance(model, Eagle3DraftModel):
            raise ValueError(f"Eagle3Proposer.model: expected an Eagle3DraftModel, received {type(model).__name__}.")
        self.model = model.eval()
        self.max_proposal_len = int(k if k is not None else model.config.ttt_steps)
        if self.max_proposal_len < 1:
            raise ValueError(f"Eagle3Proposer.k: expected >= 1, received {self.max_proposal_len}.")
        self.max_positions = int(max_positions if max_positions is not None
                                 else model.config.max_position_embeddings)
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.tokens: list[int] = []  # committed tokens by position (0 .. num_features - 1)
        self.pending: list[Tensor] = []  # features [F] of positions cache.length .. num_features - 1
        self.last_hidden: Tensor | None = None  # step-0 output of the last committed row

    @property
    def num_features(self) -> int:
        return self.cache.length + len(self.pending)

    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: Tensor | list[int]) -> None:
        ids = [int(t) for t in (token_ids_T.tolist() if isinstance(token_ids_T, Tensor) else token_ids_T)]
        if len(ids) != target_hidden_TF.shape[0]:
            raise ValueError(f"Eagle3Proposer.extend_context: expected {target_hidden_TF.shape[0]} token ids (one per "
                             f"feature row), received {len(ids)}.")
        start = self.num_features
        del self.tokens[start:]
        self.tokens.extend(ids)
        self.pending.extend(target_hidden_TF.unbind(0))

    @torch.no_grad()
    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        m = self.model
        dev = m.fc.weight.device
        if anchor_pos < 1 or self.num_features != anchor_pos:
            raise ValueError(f"Eagle3Proposer.propose: expected features of exactly positions 0..{anchor_pos - 1}, "
                             f"received {self.num_features}.")
        n_max = min(self.max_proposal_len, self.max_positions - 1 - int(anchor_pos))
        if n_max <= 0:
            return Proposal.empty(dev)
        del self.tokens[anchor_pos:]
        self.tokens.append(int(anchor_token))
        # Commit rows cache.length .. anchor_pos - 1 (row t reads token t + 1; the last reads the anchor).
        start = self.cache.length
        if self.pending:
            next_ids = torch.tensor(self.tokens[start + 1: anchor_pos + 1], dtype=torch.long, device=dev)
            self.last_hidden = m.commit_rows(self.cache, next_ids, torch.stack(self.pending))[-1]
            self.pending = []
        hidden = self.last_hidden
        chain_k: list[Tensor] = []
        chain_v: list[Tensor] = []
        ids, probs_rows = [], []
        for j in range(n_max):
            if j > 0:
                hidden = m.chain_step(self.cache, chain_k, chain_v, ids[-1], hidden, anchor_pos - 1 + j)
            draft_tok, q_W = draw_token(m.logits(hidden), sampling, generator)
            if q_W is not None:
                probs_rows.append(q_W if m.d2t is None else scatter_to_target(q_W, m.d2t, m.config.vocab_size))
            ids.append(m.target_ids(draft_tok))  # the next chain step embeds the target id
        return Proposal(draft_ids_N=torch.cat(ids).long(),
                        draft_probs_NV=torch.stack(probs_rows) if probs_rows else None)
