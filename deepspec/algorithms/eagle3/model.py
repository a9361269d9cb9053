"""Eagle3 draft model (the TTT loss is :mod:`.loss`, the drafter :mod:`.proposer`).

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
chain's own earlier steps. Implemented with dense SDPA over ``cat(K_0, .., K_k)`` and a bool mask;
with sampled chains (``rows_BS``) only the chain rows run past their step-0 keys and values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspec.algorithms.eagle3.config import ALGORITHM_NAME, Eagle3Config
from deepspec.models.config import CONFIG_NAME, WEIGHTS_NAME, save_draft_folder
from deepspec.models.draft_common import (
    DraftVocabMixin, check_saved_d2t, draft_from_target, load_draft_weights, qk_norms, split_heads)


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
                mask: Tensor | None, is_causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Queries/keys/values of the T new rows; attend to ``cat(prev, new)`` under ``mask`` (bool
        ``[.., T, P+T]``, True = visible; None = everything visible, or with ``is_causal`` and no ``prev``
        the causal rule, which SDPA's kernels run without reading a mask: about half a dense mask's time
        over a long prompt). Returns (out ``[B, T, H]``, new K (RoPE'd), new V), both ``[B, Hk, T, d]``.

        Raises ValueError for ``is_causal`` with a mask or with earlier rows (SDPA aligns its causal rule
        to the top left, which is wrong once queries follow cached keys)."""
        if is_causal and (mask is not None or prev_k is not None):
            raise ValueError("Eagle3Attention: is_causal expects no mask and no earlier rows.")
        B, T, _ = x_BT2.shape
        q = self._split(self.q_proj(x_BT2), self.num_heads, self.q_norm)
        k = self._split(self.k_proj(x_BT2), self.num_kv_heads, self.k_norm)
        v = self._split(self.v_proj(x_BT2), self.num_kv_heads, None)
        q, k = self._apply_rope(q, k, cos, sin)
        k_all = k if prev_k is None else torch.cat([prev_k.expand(B, -1, -1, -1), k], dim=2)
        v_all = v if prev_v is None else torch.cat([prev_v.expand(B, -1, -1, -1), v], dim=2)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=is_causal,
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

    def forward(self, emb_BTH: Tensor, hid_BTH: Tensor, cos, sin, prev_k, prev_v, mask, is_causal: bool = False):
        x = torch.cat([self.input_layernorm(emb_BTH), self.hidden_norm(hid_BTH)], dim=-1)
        attn, k, v = self.self_attn(x, cos, sin, prev_k, prev_v, mask, is_causal)
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
        self.rotary_emb = c.rotary_embedding(hf)
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
                      steps: int | None = None, *, rows_BS: Tensor | None = None) -> list[Tensor]:
        """The K unrolled TTT steps; returns the pre-norm hidden states ``[B, S, H]`` of each step
        (row t of step k predicts ``x_{t+k+2}``; rows whose inputs run past S are garbage, never
        supervised, and never seen by supervised rows).

        ``rows_BS`` (bool ``[B, S]``, the chains the loss supervises): only those rows are computed
        past their step-0 keys and values (:meth:`_forward_train_rows`); every other row of the
        returned tensors is 0. The chain rows' states equal the all-rows forward's: a row's step k
        reads only the step-0 keys of rows ``<= t`` (computed for every row) and its own earlier
        steps."""
        if rows_BS is not None:
            return self._forward_train_rows(input_ids_BS, target_hidden_BSF, rows_BS.bool(), steps)
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
            emb = self.embed(tok).to(hid.dtype)
            cos, sin = self.rotary_emb(hid, (torch.arange(S, device=dev) + k).unsqueeze(0))
            prev_k = torch.cat(ks, dim=2) if ks else None
            prev_v = torch.cat(vs, dim=2) if vs else None
            hid, kk, vv = self.midlayer(emb, hid, cos, sin, prev_k, prev_v, masks[k])
            ks.append(kk)
            vs.append(vv)
            outs.append(hid)
        return outs

    def _forward_train_rows(self, input_ids_BS: Tensor, target_hidden_BSF: Tensor, rows_BS: Tensor,
                            steps: int | None) -> list[Tensor]:
        """:meth:`forward_train` for the chain rows ``rows_BS`` only (R = the most chains of a sequence).

        Step 0 projects every row to its keys/values (``K_0``: what later rows and steps attend to);
        the queries, attention outputs and MLP run on the R chain rows of each step only, so a step
        costs R rows instead of S (a CPU step with 16 chains of a 384-token sequence: about a tenth)."""
        K = self.config.ttt_steps if steps is None else steps
        layer, attn = self.midlayer, self.midlayer.self_attn
        B, S = input_ids_BS.shape
        dev = input_ids_BS.device
        ids = input_ids_BS.long()
        hid_BSH = self.fc(target_hidden_BSF.to(self.fc.weight.dtype))
        next_BS = torch.zeros_like(ids)  # row t's step-0 token x_{t+1} (past the end: 0)
        next_BS[:, : S - 1] = ids[:, 1:]
        x0 = torch.cat([layer.input_layernorm(self.embed(next_BS).to(hid_BSH.dtype)),
                        layer.hidden_norm(hid_BSH)], dim=-1)
        cos0, sin0 = self.rotary_emb(hid_BSH, torch.arange(S, device=dev).unsqueeze(0))
        k0 = attn._split(attn.k_proj(x0), attn.num_kv_heads, attn.k_norm)
        v0 = attn._split(attn.v_proj(x0), attn.num_kv_heads, None)
        k0 = attn._apply_rope(k0, k0, cos0, sin0)[1]

        counts = rows_BS.sum(dim=1)
        R = max(int(counts.max()), 1)
        t_BR = torch.zeros(B, R, dtype=torch.long, device=dev)  # padding: row 0, never returned
        valid_BR = torch.arange(R, device=dev).unsqueeze(0) < counts.unsqueeze(1)
        t_BR[valid_BR] = rows_BS.nonzero(as_tuple=True)[1]
        b_BR = torch.arange(B, device=dev).unsqueeze(1).expand(B, R)
        causal_BRS = torch.arange(S, device=dev).view(1, 1, S) <= t_BR.unsqueeze(-1)  # step-0 keys of rows <= t
        eye_RR = torch.eye(R, dtype=torch.bool, device=dev).expand(B, R, R)
        gqa = attn.num_heads != attn.num_kv_heads
        hid = hid_BSH[b_BR, t_BR]  # [B, R, H]
        ks, vs, outs = [k0], [v0], []
        for k in range(K):
            pos_BR = t_BR + 1 + k  # token x_{t+1+k} (past the end: 0, an unsupervised row)
            tok_BR = torch.where(pos_BR < S, ids[b_BR, pos_BR.clamp(max=S - 1)], torch.zeros_like(pos_BR))
            x = x0[b_BR, t_BR] if k == 0 else torch.cat(
                [layer.input_layernorm(self.embed(tok_BR).to(hid.dtype)), layer.hidden_norm(hid)], dim=-1)
            cos, sin = self.rotary_emb(hid, t_BR + k)
            q = attn._split(attn.q_proj(x), attn.num_heads, attn.q_norm)
            if k == 0:
                q = attn._apply_rope(q, q, cos, sin)[0]
            else:  # the chain's own key of this step joins the diagonal
                kk = attn._split(attn.k_proj(x), attn.num_kv_heads, attn.k_norm)
                vv = attn._split(attn.v_proj(x), attn.num_kv_heads, None)
                q, kk = attn._apply_rope(q, kk, cos, sin)
                ks.append(kk)
                vs.append(vv)
            mask = torch.cat([causal_BRS] + [eye_RR] * k, dim=-1).unsqueeze(1)
            out = F.scaled_dot_product_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), attn_mask=mask,
                                                 enable_gqa=gqa)
            h = hid + attn.o_proj(out.transpose(1, 2).reshape(B, R, attn.num_heads * attn.head_dim))
            hid = h + layer.mlp(layer.post_attention_layernorm(h))
            full = hid_BSH.new_zeros(B, S, hid.shape[-1])
            outs.append(full.index_put((b_BR[valid_BR], t_BR[valid_BR]), hid[valid_BR]))
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
        emb = self.embed(next_token_ids_T.to(dev).long().view(1, T)).to(hid.dtype)
        L = cache.length
        cos, sin = self.rotary_emb(hid, torch.arange(L, L + T, device=dev).unsqueeze(0))
        if L == 0:  # a request's prompt: the causal rule alone, no dense [T, T] mask
            out, k, v = self.midlayer(emb, hid, cos, sin, None, None, None, is_causal=True)
        else:
            mask = torch.ones(T, L + T, dtype=torch.bool, device=dev)
            mask[:, L:] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            out, k, v = self.midlayer(emb, hid, cos, sin, cache.k, cache.v, mask)
        cache.k = k if cache.k is None else torch.cat([cache.k, k], dim=2)
        cache.v = v if cache.v is None else torch.cat([cache.v, v], dim=2)
        cache.length += T
        return out[0]

    @torch.no_grad()
    def tree_step(self, cache: Eagle3Cache, step_k: list[Tensor], step_v: list[Tensor], token_ids_X: Tensor,
                  hidden_XH: Tensor, pos: int, visible_XM: Tensor | None = None) -> Tensor:
        """One drafting step k >= 1 for X nodes of the same depth, all at RoPE position ``pos``: node ``x`` reads
        (its token ``token_ids_X[x]``, its parent's pre-norm output ``hidden_XH[x]``) and attends to every
        committed row, to the M earlier steps' K/V held in ``step_k``/``step_v`` where ``visible_XM`` (bool
        ``[X, M]``) is True, and to itself: the TTT attention rule along each node's path, so a chain
        (X = 1, ``visible_XM`` None: every earlier step visible) is the case the training masks
        (:func:`ttt_masks`) describe, and a draft tree passes each node's ancestors. Appends the X new K/V
        (``[1, Hk, X, d]``) to the lists; returns the pre-norm outputs ``[X, H]``."""
        dev = self.fc.weight.device
        X = int(token_ids_X.shape[0])
        hid = hidden_XH.reshape(1, X, -1)
        emb = self.embed(token_ids_X.to(dev).long().view(1, X)).to(hid.dtype)
        cos, sin = self.rotary_emb(hid, torch.full((1, X), int(pos), device=dev))
        prev_k = torch.cat([cache.k, *step_k], dim=2)
        prev_v = torch.cat([cache.v, *step_v], dim=2)
        mask = None
        if X > 1 or visible_XM is not None:
            L, M = cache.length, prev_k.shape[2] - cache.length
            mask = torch.ones(X, L + M + X, dtype=torch.bool, device=dev)
            if visible_XM is not None:
                mask[:, L:L + M] = visible_XM.to(dev)
            mask[:, L + M:] = torch.eye(X, dtype=torch.bool, device=dev)
        out, k, v = self.midlayer(emb, hid, cos, sin, prev_k, prev_v, mask)
        step_k.append(k)
        step_v.append(v)
        return out[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft's W tokens (draft ids; ``target_ids`` maps them)."""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """``model.safetensors`` (all weights, self-contained) + ``config.json`` with
        ``deepspec_algorithm: eagle3`` and ``layer_types`` (the draft layer's own attention, always
        ``full_attention``), written atomically as a folder."""

        cfg = {"architectures": ["Eagle3DraftModel"], "model_type": "eagle3", "deepspec_algorithm": ALGORITHM_NAME,
               "layer_types": ["full_attention"], "eagle3_config": self.config.to_dict()}
        return save_draft_folder(out_dir, self.state_dict(), cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu") -> Eagle3DraftModel:
        path = Path(path)
        weights = load_draft_weights(path, CONFIG_NAME, WEIGHTS_NAME, "Eagle3DraftModel.from_pretrained")
        cfg = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
        if cfg.get("deepspec_algorithm") != ALGORITHM_NAME:
            raise ValueError(f"Eagle3DraftModel.from_pretrained: {path} holds a "
                             f"{cfg.get('deepspec_algorithm', 'dspark/dflash')!r} draft, not an Eagle3 one.")
        config = Eagle3Config.from_dict(cfg["eagle3_config"])
        model = cls(config)
        model.load_state_dict(check_saved_d2t(weights, config, str(path / WEIGHTS_NAME)), strict=True)
        model.freeze_embeddings()
        return model.to(device)
