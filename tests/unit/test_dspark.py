"""DSpark draft model: config derivation, no-leak, train/inference consistency, save/load, proposer.

Legend: B batch, S seq, A anchors, K block, V vocab, F feature width. Tiny random targets only.
"""

import dataclasses

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from deepspec.algorithms.dspark.config import MARKOV_HEAD_TYPES, DraftConfig, dflash_knobs, draft_config_from_target
from deepspec.algorithms.dspark.loss import dspark_loss
from deepspec.algorithms.dspark.model import DSparkDraftModel, GatedMarkovHead, MarkovHead, RNNMarkovHead
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.decoding.verify import SamplingParams
from deepspec.models.anchors import sample_anchors
from tests.helpers import require_flex_attention_on_cpu

V, MASK = 64, 5
LAYER_IDS = [0, 1]


def tiny_target(family="llama", seed=0):
    torch.manual_seed(seed)
    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
              num_hidden_layers=4, vocab_size=V, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True,
              max_position_embeddings=128)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[family]
    return model_cls(cfg_cls(**kw)).eval()


def capture(target, ids_BS):
    """Stand-in for deepspec.target.capture.target_forward (features = hidden_states[i+1])."""
    with torch.no_grad():
        out = target(ids_BS, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], -1)
    return feats, out.hidden_states[-1]


def make_draft(family="llama", seed=0, **kw):
    target = tiny_target(family, seed)
    cfg = draft_config_from_target(target.config, num_draft_layers=2, target_layer_ids=LAYER_IDS,
                                   mask_token_id=MASK, markov_rank=8, **kw)
    torch.manual_seed(seed + 1)
    draft = DSparkDraftModel.from_target(target, cfg)
    # give the Markov head a non-zero bias (and the gated / rnn variants non-trivial gates) so tests exercise it
    if draft.markov_head is not None:
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)
        for name in ("gate_proj", "joint_proj"):
            if hasattr(draft.markov_head, name):
                torch.nn.init.normal_(getattr(draft.markov_head, name).weight, std=0.5)
                torch.nn.init.normal_(getattr(draft.markov_head, name).bias, std=0.5)
    return target, draft


def batch(B=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, V, (B, S), generator=g)
    lm = torch.ones(B, S, dtype=torch.uint8)
    lm[:, :4] = 0
    return ids, lm


# ----------------------------------------------------------------------------- config
def test_config_from_llama_and_qwen3():
    for fam in ("llama", "qwen3"):
        t = tiny_target(fam)
        cfg = draft_config_from_target(t.config, num_draft_layers=2, target_layer_ids=LAYER_IDS, mask_token_id=MASK)
        assert cfg.family == fam and cfg.qk_norm == (fam == "qwen3")
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
        assert cfg.feature_width == 64 and cfg.vocab_size == V and cfg.max_position_embeddings == 128
        assert cfg.rope_parameters["rope_theta"] == t.config.rope_parameters["rope_theta"]
        assert DraftConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_qwen3_backbone_for_every_family(family):
    """--draft-backbone qwen3: per-head q/k RMSNorm and no bias whatever the family (the layer vLLM's
    DSpark loader builds); target: the family's own (q/k norm for Qwen3 only, q/k/v bias for Qwen2)."""
    t = tiny_target(family)
    own = draft_config_from_target(t.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK)
    qwen3 = draft_config_from_target(t.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                     backbone="qwen3")
    assert (own.qk_norm, own.qkv_bias, own.o_bias) == (family == "qwen3", family == "qwen2", False)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias, qwen3.mlp_bias) == (True, False, False, False)
    assert qwen3.family == family and DraftConfig.from_dict(qwen3.to_dict()) == qwen3
    attn = DSparkDraftModel(qwen3).layers[0].self_attn
    assert attn.q_norm is not None and attn.q_proj.bias is None and attn.q_norm.weight.shape == (8,)
    with pytest.raises(ValueError, match="backbone: expected one of"):
        draft_config_from_target(t.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                 backbone="llama")


def test_auto_backbone_per_algorithm(tmp_path):
    from deepspec.algorithms.registry import get_algorithm
    from deepspec.models.config import draft_backbone
    from deepspec.train.config import TrainConfig
    from tests.unit.test_chat import tiny_chatml_tokenizer

    tok = tiny_chatml_tokenizer()
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64))

    def qk_norm(algorithm, **kw):  # Llama layers have none: q/k norm means the qwen3 backbone
        cfg = TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", algorithm=algorithm, **kw)
        return get_algorithm(algorithm).build(target, tok, cfg.options, [0, 1]).config.qk_norm

    assert [qk_norm(a) for a in ("dspark", "dflash", "eagle3")] == [True, True, False]
    assert not qk_norm("dspark", init_from_target=True)  # a copy needs the family's layer
    assert qk_norm("eagle3", draft_backbone="qwen3")
    assert draft_backbone("auto", "qwen3") == "qwen3" and draft_backbone("target", "qwen3") == "target"
    with pytest.raises(ValueError, match="train.draft_backbone: expected auto, target or qwen3, got 'gemma'"):
        draft_backbone("gemma", "qwen3")
    with pytest.raises(ValueError, match="train.draft_backbone: expected auto, target or qwen3, got 'gemma'"):
        TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", draft_backbone="gemma")


def test_config_qwen3_4b_from_config_alone():
    tc = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=9728, num_hidden_layers=36, vocab_size=151936, max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6)
    cfg = draft_config_from_target(tc, num_draft_layers=5, target_layer_ids=[1, 9, 17, 25, 33],
                                   mask_token_id=151669, pad_token_id=151643, eos_token_ids=[151645, 151643])
    assert cfg.feature_width == 5 * 2560 and cfg.qk_norm and cfg.architecture == "Qwen3DSparkModel"


@pytest.mark.parametrize("kw, field", [
    (dict(mask_token_id=0), "mask_token_id"),  # == pad
    (dict(mask_token_id=1), "mask_token_id"),  # == eos
    (dict(mask_token_id=V), "mask_token_id"),  # out of range
    (dict(target_layer_ids=[0, 3]), "target_layer_ids"),  # L-1
    (dict(target_layer_ids=[0, 0]), "target_layer_ids"),
    (dict(markov_rank=0), "markov_rank"),
    (dict(markov_head_type="lstm"), "markov_head_type"),
])
def test_config_validation(kw, field):
    t = tiny_target()
    args = dict(num_draft_layers=2, target_layer_ids=LAYER_IDS, mask_token_id=MASK)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        draft_config_from_target(t.config, **args)


def test_config_unknown_knob_and_family():
    t = tiny_target()
    with pytest.raises(ValueError, match="unknown"):
        draft_config_from_target(t.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                 ce_wieght=1.0)
    t.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type"):
        draft_config_from_target(t.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK)


# ----------------------------------------------------------------------------- model
def test_parameter_names_and_frozen_copies():
    target, draft = make_draft("qwen3")
    names = {n for n, _ in draft.named_parameters()}
    for n in ("embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
              "layers.1.self_attn.q_proj.weight", "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight",
              "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
              "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert n in names, n
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight)
    assert draft.embed_tokens.weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()
    assert draft.confidence_head.proj.in_features == 32 + 8


def _forward(draft, *args, use_flex):
    import warnings

    if not use_flex:
        return draft.forward_train(*args, use_flex=False)
    require_flex_attention_on_cpu()
    with warnings.catch_warnings(), torch.no_grad():  # flex on CPU: forward only
        warnings.simplefilter("ignore")
        return draft.forward_train(*args, use_flex=True)


@pytest.mark.parametrize("use_flex", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_never_sees_context_at_or_after_anchor(family, use_flex):
    target, draft = make_draft(family, markov_head_type="rnn")
    ids, _ = batch(B=1)
    feats, _ = capture(target, ids)
    ap = torch.tensor([[6, 9, 15]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    base = _forward(draft, ids, feats, ap, valid, use_flex=use_flex)
    feats2 = feats.clone()
    feats2[:, 9:] += torch.randn_like(feats2[:, 9:])  # changes context at/after anchor 9
    ids2 = ids.clone()
    ids2[:, 16:] = 7  # tokens beyond blocks' anchors (block 2 prev tokens change -> only its logits)
    out = _forward(draft, ids2, feats2, ap, valid, use_flex=use_flex)
    torch.testing.assert_close(out.logits_BAKV[:, :2], base.logits_BAKV[:, :2])
    assert not torch.allclose(out.logits_BAKV[:, 2], base.logits_BAKV[:, 2])
    # the feature AT the anchor position alone: still invisible to that block (strictly before)
    feats3 = feats.clone()
    feats3[:, 9] += 5.0
    out3 = _forward(draft, ids, feats3, ap, valid, use_flex=use_flex)
    torch.testing.assert_close(out3.logits_BAKV[:, :2], base.logits_BAKV[:, :2])
    assert not torch.allclose(out3.logits_BAKV[:, 2], base.logits_BAKV[:, 2])  # block at 15 sees position 9


@pytest.mark.parametrize("markov, backbone", [(m, "target") for m in MARKOV_HEAD_TYPES] + [("vanilla", "qwen3")])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_training_and_inference_paths_agree(family, markov, backbone):
    target, draft = make_draft(family, markov_head_type=markov, backbone=backbone)
    ids, lm = batch(B=2, S=24)
    feats, _ = capture(target, ids)
    ap = torch.tensor([[4, 6, 20], [0, 11, 0]])  # overlapping, near the end, padding
    valid = torch.tensor([[True, True, True], [True, True, False]])
    out = draft.forward_train(ids, feats, ap, valid)
    K = draft.config.block_size
    for b in range(2):
        for j in range(3):
            if not valid[b, j]:
                continue
            a = int(ap[b, j])
            cache = draft.new_context_cache()
            draft.append_context(cache, feats[b, :max(a - 3, 0)])  # appended in two pieces
            draft.append_context(cache, feats[b, max(a - 3, 0):a])
            hidden_KD, base_KV = draft.block_hidden(cache, int(ids[b, a]), a)
            prev = ids[b, (a + torch.arange(K)).clamp(max=ids.shape[1] - 1)]
            logits_KV, conf_K = draft.heads(hidden_KD, prev)
            torch.testing.assert_close(logits_KV, out.logits_BAKV[b, j], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(conf_K, out.confidence_logits_BAK[b, j], atol=1e-5, rtol=1e-5)
    # crop: a longer cache cropped back gives the same block
    cache = draft.new_context_cache()
    draft.append_context(cache, feats[0, :15])
    cache.crop(9)
    h2, _ = draft.block_hidden(cache, int(ids[0, 9]), 9)
    cache = draft.new_context_cache()
    draft.append_context(cache, feats[0, :9])
    h1, _ = draft.block_hidden(cache, int(ids[0, 9]), 9)
    torch.testing.assert_close(h1, h2)
    with pytest.raises(ValueError, match="context cache"):
        draft.block_hidden(cache, 7, 10)


def test_flex_path_matches_dense_forward_on_cpu():
    import warnings

    target, draft = make_draft("qwen3")
    ids, _ = batch(B=2, S=20)
    feats, _ = capture(target, ids)
    ap = torch.tensor([[3, 5, 17], [2, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    dense = draft.forward_train(ids, feats, ap, valid, use_flex=False)
    require_flex_attention_on_cpu()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        flex = draft.forward_train(ids, feats, ap, valid, use_flex=True)
    torch.testing.assert_close(flex.logits_BAKV, dense.logits_BAKV, atol=1e-4, rtol=1e-4)


def test_training_steps_decrease_loss():
    target, draft = make_draft("llama")
    ids, lm = batch(B=2, S=32, seed=3)
    feats, last = capture(target, ids)
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ap, valid = sample_anchors(lm, 6, g)
    losses = []
    for _ in range(20):
        out = draft.forward_train(ids, feats, ap, valid)
        lo = dspark_loss(out, ids, lm, ap, valid, last, draft.lm_head, draft.config)
        opt.zero_grad()
        lo.loss.backward()
        assert draft.lm_head.weight.grad is None and draft.embed_tokens.weight.grad is None
        opt.step()
        losses.append(float(lo.loss.detach()))
    assert losses[-1] < losses[0] * 0.9


def test_save_load_roundtrip(tmp_path):
    target, draft = make_draft("qwen3")
    ids, _ = batch(B=1)
    feats, _ = capture(target, ids)
    ap, valid = torch.tensor([[3, 10]]), torch.ones(1, 2, dtype=torch.bool)
    path = draft.save_pretrained(tmp_path / "draft")
    import json
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    loaded = DSparkDraftModel.from_pretrained(path)
    assert not loaded.lm_head.weight.requires_grad
    torch.testing.assert_close(loaded.forward_train(ids, feats, ap, valid).logits_BAKV,
                               draft.forward_train(ids, feats, ap, valid).logits_BAKV)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp leftovers


def test_dflash_config_has_no_heads():
    target, draft = make_draft("llama", **dflash_knobs())
    assert draft.markov_head is None and draft.confidence_head is None
    ids, lm = batch(B=1)
    feats, _ = capture(target, ids)
    out = draft.forward_train(ids, feats, torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool))
    assert out.confidence_logits_BAK is None
    lo = dspark_loss(out, ids, lm, torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool), None, draft.lm_head,
                     draft.config)
    assert torch.isclose(lo.loss, lo.ce)


# ----------------------------------------------------------------------------- proposer
@pytest.mark.parametrize("markov", MARKOV_HEAD_TYPES)
def test_proposer_greedy_matches_serial_markov_and_respects_limits(markov):
    target, draft = make_draft("llama", markov_head_type=markov)
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    prop = DSparkProposer(draft, max_positions=128)
    assert prop.max_proposal_len == 7
    prop.extend_context(feats[0, :12], ids[0, :12].tolist())
    p = prop.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None)
    assert p.draft_ids_N.shape == (7,) and p.draft_probs_NV is None and p.confidence_N.shape == (7,)
    # greedy oracle: serial Markov correction using the drafted tokens
    cache = draft.new_context_cache()
    draft.append_context(cache, feats[0, :12])
    hidden_KD, _ = draft.block_hidden(cache, int(ids[0, 12]), 12)
    prev = torch.cat([ids[0, 12:13], p.draft_ids_N[:-1]])
    logits_KV, conf_K = draft.heads(hidden_KD, prev)
    assert torch.equal(logits_KV.argmax(-1), p.draft_ids_N)
    torch.testing.assert_close(torch.sigmoid(conf_K), p.confidence_N)
    # position limit: positions 13.. must stay < max_positions=16 -> 3 tokens
    short = DSparkProposer(draft, max_positions=16)
    short.extend_context(feats[0, :12], ids[0, :12].tolist())
    assert short.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None).num_proposed == 3
    # confidence cut: threshold above every confidence -> empty proposal; 0 -> full
    cut = DSparkProposer(draft, confidence_threshold=1.0)
    cut.extend_context(feats[0, :12], ids[0, :12].tolist())
    assert cut.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None).num_proposed == 0
    prop.reset()
    assert prop.cache.length == 0


def test_context_is_appended_at_the_next_proposal_in_one_forward():
    """extend_context only queues the features (a step without a proposal runs no draft forward); the next
    propose appends every queued position in one call, and proposes what a proposer fed the same positions
    at once proposes. A bad feature shape is refused when it is given, not at the proposal."""
    target, draft = make_draft("llama")
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    calls = []
    append = draft.append_context
    draft.append_context = lambda cache, f: (calls.append(f.shape[0]), append(cache, f))
    stepwise, whole = DSparkProposer(draft), DSparkProposer(draft)
    stepwise.extend_context(feats[0, :9], ids[0, :9].tolist())
    for i in range(9, 12):  # three plain steps: one committed position each
        stepwise.extend_context(feats[0, i:i + 1], ids[0, i:i + 1].tolist())
    assert calls == [] and stepwise.cache.length == 0
    p = stepwise.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None)
    assert calls == [12] and stepwise.cache.length == 12 and stepwise.pending == []
    whole.extend_context(feats[0, :12], ids[0, :12].tolist())
    q = whole.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None)
    assert torch.equal(p.draft_ids_N, q.draft_ids_N)
    torch.testing.assert_close(p.confidence_N, q.confidence_N)
    with pytest.raises(ValueError, match="extend_context.*shape"):
        stepwise.extend_context(feats[0, :2, :-1], ids[0, :2].tolist())
    stepwise.reset()
    assert stepwise.pending == [] and stepwise.cache.length == 0


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "t1"])
def test_confidence_cut_mid_block_keeps_the_slots_before_the_first_low_one(sampling):
    """A threshold between the block's confidences cuts the proposal before the first slot below it, whichever
    slot that is: the slots before it are the uncut proposal's (tokens, confidences and, at T > 0, draft rows,
    drawn from the same generator). A threshold equal to every slot's confidence or 0 cuts nothing."""
    target, draft = make_draft("llama")
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)

    def propose(threshold):
        prop = DSparkProposer(draft, max_positions=128, confidence_threshold=threshold)
        prop.extend_context(feats[0, :12], ids[0, :12].tolist())
        return prop.propose(int(ids[0, 12]), 12, sampling=sampling, generator=torch.Generator().manual_seed(0))

    full = propose(None)
    conf = full.confidence_N.tolist()
    cuts = []
    for j in range(1, len(conf)):
        if min(conf[:j]) > conf[j]:  # a threshold in between cuts at slot j
            cut = propose((min(conf[:j]) + conf[j]) / 2)
            assert cut.draft_ids_N.tolist() == full.draft_ids_N[:j].tolist(), (j, conf)
            assert torch.equal(cut.confidence_N, full.confidence_N[:j])
            if not sampling.greedy:
                assert torch.equal(cut.draft_probs_NV, full.draft_probs_NV[:j])
            cuts.append(j)
    assert cuts, conf  # the block's confidences do fall below an earlier slot's
    assert propose(min(conf)).num_proposed == propose(0.0).num_proposed == len(conf)


def test_proposer_sampling_probs_and_determinism():
    target, draft = make_draft("qwen3")
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    results = []
    for _ in range(2):
        prop = DSparkProposer(draft)
        prop.extend_context(feats[0, :10], ids[0, :10].tolist())
        p = prop.propose(int(ids[0, 10]), 10, sampling=SamplingParams(temperature=0.8),
                         generator=torch.Generator().manual_seed(5))
        assert p.draft_probs_NV.dtype == torch.float32 and p.draft_probs_NV.shape == (7, V)
        torch.testing.assert_close(p.draft_probs_NV.sum(-1), torch.ones(7))
        assert (p.draft_probs_NV.gather(1, p.draft_ids_N[:, None]) > 0).all()
        results.append(p.draft_ids_N)
    assert torch.equal(results[0], results[1])


# ----------------------------------------------------------------------------- Markov head variants
def test_markov_variant_parameters_and_saved_config(tmp_path):
    import json

    expected = {"vanilla": (MarkovHead, set()),
                "gated": (GatedMarkovHead, {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}),
                "rnn": (RNNMarkovHead, {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"})}
    for markov, (cls, extra) in expected.items():
        target, draft = make_draft("llama", markov_head_type=markov)
        assert type(draft.markov_head) is cls
        names = {n for n, _ in draft.named_parameters() if n.startswith("markov_head.")}
        assert names == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} | extra
        path = draft.save_pretrained(tmp_path / markov)
        assert json.loads((path / "config.json").read_text())["draft_config"]["markov_head_type"] == markov
        loaded = DSparkDraftModel.from_pretrained(path)
        assert type(loaded.markov_head) is cls
        ids, _ = batch(B=1)
        feats, _ = capture(target, ids)
        ap, valid = torch.tensor([[3, 10]]), torch.ones(1, 2, dtype=torch.bool)
        torch.testing.assert_close(loaded.forward_train(ids, feats, ap, valid).logits_BAKV,
                                   draft.forward_train(ids, feats, ap, valid).logits_BAKV)
    # a config.json written before the field existed loads as vanilla
    d = draft.config.to_dict()
    del d["markov_head_type"]
    assert DraftConfig.from_dict(d).markov_head_type == "vanilla"


def _serial_bias(head, prev_K, hidden_KD):
    """Oracle: the variant's formula written out slot by slot with plain tensor ops."""
    W1, W2 = head.markov_w1.weight, head.markov_w2.weight
    s = torch.zeros(head.rank)
    out = []
    for k in range(prev_K.shape[0]):
        f = W1[prev_K[k]]
        if isinstance(head, GatedMarkovHead):
            g = torch.sigmoid(head.gate_proj.weight @ torch.cat([hidden_KD[k], f]) + head.gate_proj.bias)
            out.append(W2 @ (g * f))
        elif isinstance(head, RNNMarkovHead):
            z = head.joint_proj.weight @ torch.cat([s, f, hidden_KD[k]]) + head.joint_proj.bias
            r = head.rank
            g, c, o = torch.sigmoid(z[:r]), torch.tanh(z[r:2 * r]), torch.tanh(z[2 * r:])
            out.append(W2 @ o)
            s = g * s + (1 - g) * c
        else:
            out.append(W2 @ f)
    return torch.stack(out)


@pytest.mark.parametrize("markov", MARKOV_HEAD_TYPES)
def test_markov_variant_formulas_and_memory(markov):
    _, draft = make_draft("qwen3", markov_head_type=markov)
    head = draft.markov_head
    g = torch.Generator().manual_seed(0)
    K = draft.config.block_size
    prev = torch.randint(6, V, (K,), generator=g)
    hidden = torch.randn(K, 32, generator=g)
    with torch.no_grad():
        bias, feats = head.block(prev, hidden)
        torch.testing.assert_close(bias, _serial_bias(head, prev, hidden), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats, head.markov_w1.weight[prev])
        # batched blocks [2, K] equal one block at a time
        prev2, hidden2 = torch.stack([prev, prev.flip(0)]), torch.stack([hidden, hidden.flip(0)])
        torch.testing.assert_close(head.block(prev2, hidden2)[0][1], head.block(prev.flip(0), hidden.flip(0))[0])
        # memory: changing the token before slot 1 changes slot 3's bias only for the rnn head
        prev_b = prev.clone()
        prev_b[1] = (prev[1] + 1 - 6) % (V - 6) + 6
        changed = not torch.allclose(head.block(prev_b, hidden)[0][3], bias[3])
        assert changed == (markov == "rnn")
        # the hidden state matters for gated and rnn, not for vanilla
        changed = not torch.allclose(head.block(prev, hidden + 1.0)[0][0], bias[0])
        assert changed == (markov != "vanilla")


def test_gated_head_closed_gate_removes_bias():
    _, draft = make_draft("llama", markov_head_type="gated")
    with torch.no_grad():
        draft.markov_head.gate_proj.weight.zero_()
        draft.markov_head.gate_proj.bias.fill_(-50.0)
        bias, _ = draft.markov_head.block(torch.tensor([7, 8]), torch.randn(2, 32))
    assert bias.abs().max() < 1e-6


@pytest.mark.parametrize("markov", MARKOV_HEAD_TYPES)
def test_markov_variants_train(markov):
    target, draft = make_draft("llama", markov_head_type=markov)
    ids, lm = batch(B=2, S=32, seed=3)
    feats, last = capture(target, ids)
    ap, valid = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    out = draft.forward_train(ids, feats, ap, valid)
    lo = dspark_loss(out, ids, lm, ap, valid, last, draft.lm_head, draft.config)
    lo.loss.backward()
    for n, p in draft.markov_head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_registry_build_passes_markov_head(tmp_path):
    from deepspec.algorithms.registry import algorithm_for_model, get_algorithm
    from deepspec.train.config import TrainConfig
    from tests.unit.test_chat import tiny_chatml_tokenizer

    tok = tiny_chatml_tokenizer()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64))
    for markov in MARKOV_HEAD_TYPES:
        cfg = TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", markov_rank=8, markov_head=markov)
        draft = get_algorithm("dspark").build(target, tok, cfg, [0, 1])
        assert draft.config.markov_head_type == markov and draft.markov_head.head_type == markov
        assert algorithm_for_model(draft).name == "dspark"
    # loss weights given to train reach the draft's config (the rest keep the algorithm's own)
    cfg = TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", markov_rank=8, ce_weight=1.0,
                      l1_weight=0.1, loss_decay_gamma=2.0)
    c = get_algorithm("dspark").build(target, tok, cfg, [0, 1]).config
    assert (c.ce_weight, c.l1_weight, c.confidence_weight, c.loss_decay_gamma) == (1.0, 0.1, 1.0, 2.0)
    c = get_algorithm("dflash").build(target, tok, TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl",
                                                                algorithm="dflash", loss_decay_gamma=2.0), [0, 1]).config
    assert (c.ce_weight, c.l1_weight, c.confidence_weight, c.loss_decay_gamma) == (1.0, 0.0, 0.0, 2.0)
    c = get_algorithm("dflash").build(target, tok, TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl",
                                                                algorithm="dflash", ce_weight=0.5, l1_weight=0.5),
                                      [0, 1]).config
    assert (c.ce_weight, c.l1_weight, c.confidence_weight) == (0.5, 0.5, 0.0)  # given weights override DFlash's own
    with pytest.raises(ValueError, match="confidence_weight"):  # DFlash has no confidence head
        get_algorithm("dflash").build(target, tok, TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl",
                                                                algorithm="dflash", confidence_weight=1.0), [0, 1])
    with pytest.raises(ValueError, match="train.block_size"):
        TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", block_size=1)
    with pytest.raises(ValueError, match="eagle3 has its own"):
        TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", algorithm="eagle3", ce_weight=1.0)
    with pytest.raises(ValueError, match="train.l1_weight"):
        TrainConfig(output_dir=str(tmp_path), online_data="unused.jsonl", l1_weight=-1.0)


# ----------------------------------------------------------------------------- attention paths
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_flex_dense_and_per_block_loop_agree_with_padding_blocks(family):
    """Block-parallel forward (dense SDPA mask and flex BlockMask) == a loop that runs each block
    alone against only its visible context (context < anchor, no mask needed); padding blocks finite."""
    target, draft = make_draft(family, markov_head_type="gated")
    ids, _ = batch(B=2, S=20)
    feats, _ = capture(target, ids)
    ap = torch.tensor([[0, 5, 6, 17], [2, 13, 0, 0]])  # anchor 0 (no context), overlapping, near the end
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    dense = _forward(draft, ids, feats, ap, valid, use_flex=False)
    flex = _forward(draft, ids, feats, ap, valid, use_flex=True)
    assert torch.isfinite(dense.logits_BAKV).all() and torch.isfinite(flex.logits_BAKV).all()
    assert torch.isfinite(dense.confidence_logits_BAK).all()
    torch.testing.assert_close(flex.logits_BAKV, dense.logits_BAKV, atol=1e-4, rtol=1e-4)
    K, S = draft.config.block_size, ids.shape[1]
    with torch.no_grad():
        for b in range(2):
            for j in range(4):
                if not valid[b, j]:
                    continue
                a = int(ap[b, j])
                cache = draft.new_context_cache()
                draft.append_context(cache, feats[b, :a])
                hidden_KD, _ = draft.block_hidden(cache, int(ids[b, a]), a)
                logits_KV, _ = draft.heads(hidden_KD, ids[b, (a + torch.arange(K)).clamp(max=S - 1)])
                torch.testing.assert_close(dense.logits_BAKV[b, j], logits_KV, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(flex.logits_BAKV[b, j], logits_KV, atol=1e-4, rtol=1e-4)


def test_padding_blocks_carry_no_loss_and_no_gradient():
    """Adding padding blocks (wherever their placeholder anchor points) changes neither the loss nor
    any gradient, and produces no NaN."""
    target, draft = make_draft("qwen3", markov_head_type="rnn")
    ids, lm = batch(B=1, S=24)
    feats, last = capture(target, ids)

    def loss_and_grads(ap, valid):
        draft.zero_grad()
        out = draft.forward_train(ids, feats, ap, valid)
        assert torch.isfinite(out.logits_BAKV).all() and torch.isfinite(out.confidence_logits_BAK).all()
        lo = dspark_loss(out, ids, lm, ap, valid, last, draft.lm_head, draft.config)
        lo.loss.backward()
        return lo, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    lo1, g1 = loss_and_grads(torch.tensor([[5, 11]]), torch.tensor([[True, True]]))
    lo2, g2 = loss_and_grads(torch.tensor([[5, 11, 0, 23]]), torch.tensor([[True, True, False, False]]))
    assert lo1.num_valid_slots == lo2.num_valid_slots
    torch.testing.assert_close(lo2.loss, lo1.loss)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=1e-6, rtol=1e-5)
    # only padding blocks: zero loss, zero gradient, no NaN
    lo3, g3 = loss_and_grads(torch.tensor([[0, 23]]), torch.zeros(1, 2, dtype=torch.bool))
    assert float(lo3.loss.detach()) == 0.0 and all(torch.all(g == 0) for g in g3.values())


# ------------------------------------------------------------------ z-lab's DFlash layout (sample_from_anchor=False)


def test_zlab_layout_reads_out_the_mask_slots_of_the_same_block():
    """The same weights in both layouts: z-lab's draft slot j is block slot j + 1, which DeepSpec's layout
    reads as its slot j + 1 (one position further). Training forward, inference block and the
    proposal length all agree with that, and the config refuses the layout with heads."""
    _, dflash = make_draft("qwen3", **dflash_knobs())
    zlab_cfg = DraftConfig.from_dict({**dflash.config.to_dict(), "sample_from_anchor": False})
    zlab = DSparkDraftModel(zlab_cfg)
    zlab.load_state_dict(dflash.state_dict())
    assert (zlab_cfg.first_draft_slot, zlab_cfg.num_draft_slots) == (1, zlab_cfg.block_size - 1)
    target, _ = make_draft("qwen3")
    ids, lm = batch(B=2, S=24)
    feats, _ = capture(target, ids)
    ap = torch.tensor([[4, 6, 20], [0, 11, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    both = dflash.forward_train(ids, feats, ap, valid)
    own = zlab.forward_train(ids, feats, ap, valid)
    torch.testing.assert_close(own.logits_BAKV, both.logits_BAKV[:, :, 1:])
    cache = zlab.new_context_cache()
    zlab.append_context(cache, feats[0, :6])
    hidden_JD, logits_JV = zlab.block_hidden(cache, int(ids[0, 6]), 6)
    torch.testing.assert_close(logits_JV, own.logits_BAKV[0, 1], atol=1e-5, rtol=1e-5)
    assert hidden_JD.shape[0] == zlab_cfg.block_size - 1
    proposer = DSparkProposer(zlab)
    assert proposer.max_proposal_len == zlab_cfg.block_size - 1
    proposer.extend_context(feats[0, :6], ids[0, :6].tolist())
    proposal = proposer.propose(int(ids[0, 6]), 6, sampling=SamplingParams(), generator=None)
    assert proposal.draft_ids_N.tolist() == logits_JV.argmax(-1).tolist()
    with pytest.raises(ValueError, match="DraftConfig.sample_from_anchor: expected true for a draft with a Markov"):
        DraftConfig.from_dict({**make_draft("qwen3")[1].config.to_dict(), "sample_from_anchor": False})


def test_zlab_layout_loss_supervises_each_mask_slot_with_its_own_position():
    """Draft slot j of the block at a (block slot j + 1, position a + j + 1) is scored against x_{a+j+1}:
    logits that put all mass on exactly those labels give CE 0 and every slot valid."""
    _, dflash = make_draft("qwen3", **dflash_knobs())
    cfg = DraftConfig.from_dict({**dflash.config.to_dict(), "sample_from_anchor": False})
    ids, lm = batch(B=1, S=24)
    ap = torch.tensor([[5, 9]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    J = cfg.num_draft_slots
    labels_BAJ = ids[0, (ap[0, :, None] + torch.arange(1, J + 1))][None]
    logits = torch.full((1, 2, J, V), -1e4)
    logits.scatter_(-1, labels_BAJ[..., None], 1e4)
    from deepspec.algorithms.dspark.model import DraftTrainOutput

    D = cfg.hidden_size
    out = DraftTrainOutput(logits_BAKV=logits, confidence_logits_BAK=None, hidden_BAKD=torch.zeros(1, 2, J, D))
    loss = dspark_loss(out, ids, lm, ap, valid, None, torch.zeros(V, D), cfg)
    assert loss.num_valid_slots == 2 * J and float(loss.ce) == 0.0
    shifted = torch.roll(logits, 1, dims=2)  # each slot predicting its neighbour's label: a real loss
    assert float(dspark_loss(DraftTrainOutput(shifted, None, out.hidden_BAKD), ids, lm, ap, valid, None,
                             torch.zeros(V, D), cfg).ce) > 100


def test_an_unknown_activation_is_a_config_error_naming_the_field():
    cfg = make_draft("qwen3")[1].config.to_dict()
    with pytest.raises(ValueError, match="DraftConfig.hidden_act: expected an activation transformers knows.*"
                                         "'nonsense'.*hidden_act"):
        DraftConfig.from_dict({**cfg, "hidden_act": "nonsense"})


# ----------------------------------------------------------------------------- chunked (deferred) head loss
def _loss_and_grads(draft, inputs, *, defer, chunk_slots, d2t=None, stats=None, autocast=None):
    import contextlib

    ids, lm, feats, last, ap, valid = inputs
    draft.zero_grad(set_to_none=True)
    with autocast or contextlib.nullcontext():
        out = draft.forward_train(ids, feats, ap, valid, defer_logits=defer)
    assert (out.logits_BAKV is None) == defer
    lse, argmax = stats if stats is not None else (None, None)
    res = dspark_loss(out, ids, lm, ap, valid, last, draft.target_lm_head_weight, draft.config, d2t_W=d2t,
                      target_logsumexp_BS=lse, target_argmax_BS=argmax, chunk_slots=chunk_slots,
                      lm_head_rows_WH=None if d2t is None else draft.lm_head.weight, autocast=autocast)
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return res, grads


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn", "dflash", "reduced", "reduced-stats", "bf16-autocast"])
def test_deferred_head_logits_give_the_same_loss_and_gradients(variant):
    """forward_train(defer_logits=True) + the loss's checkpointed chunks: every loss term, the acceptance
    counts and every parameter's gradient equal the materialised [B, A, K, W] path's (fp32; under bf16
    autocast the chunks compute their logits in it too, so the two paths still agree)."""
    from deepspec.target.capture import target_logit_stats
    from tests.unit.test_draft_vocab import reduced_draft, some_vocab

    d2t = stats = None
    if variant.startswith("reduced"):
        d2t = some_vocab(30)
        target, draft = reduced_draft(d2t)
    else:
        kw = dflash_knobs() if variant == "dflash" else {"markov_head_type": variant.replace("bf16-autocast", "gated")}
        target, draft = make_draft("qwen3", seed=2, **kw)
    ids, lm = batch(B=2, S=24, seed=4)
    feats, last = capture(target, ids)
    ap, valid = sample_anchors(lm, 5, torch.Generator().manual_seed(1))
    if variant == "reduced-stats":
        per_row = [target_logit_stats(target, last[b], lm[b]) for b in range(2)]
        stats = torch.stack([s[0] for s in per_row]), torch.stack([s[1] for s in per_row]).long()
    inputs = (ids, lm, feats, last, ap, valid)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if variant == "bf16-autocast" else None
    full, full_grads = _loss_and_grads(draft, inputs, defer=False, chunk_slots=1024, d2t=d2t, stats=stats,
                                       autocast=autocast)
    chunked, chunked_grads = _loss_and_grads(draft, inputs, defer=True, chunk_slots=7, d2t=d2t, stats=stats,
                                             autocast=autocast)
    assert full.num_valid_slots > 7 * 3  # several chunks
    for name in ("loss", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(chunked, name), getattr(full, name), rtol=1e-5, atol=1e-6, msg=name)
    for field in dataclasses.fields(full.acceptance):
        torch.testing.assert_close(getattr(chunked.acceptance, field.name), getattr(full.acceptance, field.name))
    torch.testing.assert_close(chunked.top1_match_K, full.top1_match_K)
    assert chunked_grads.keys() == full_grads.keys() and "fc.weight" in full_grads
    if draft.markov_head is not None:
        assert "markov_head.markov_w2.weight" in full_grads  # the Markov output layer trains through the chunks
    tol = dict(rtol=1e-4, atol=1e-6) if autocast is None else dict(rtol=2e-2, atol=2e-3)  # bf16: another sum order
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, **tol, msg=name)


def test_chunked_head_loss_setting():
    """auto defers exactly when the [B, A, K, W] fp32 logits pass 256 MiB; on / off force it; else an error."""
    from deepspec.algorithms.dspark import CHUNKED_HEAD_LOSS_AUTO_BYTES, defer_head_logits

    assert not defer_head_logits("auto", 2, 64, 3, 8192)  # the demo: 12.6 MB
    assert defer_head_logits("auto", 1, 512, 7, 151_936)  # a Qwen3 draft with 512 anchors: 2.2 GB
    limit_elements = CHUNKED_HEAD_LOSS_AUTO_BYTES // 4
    assert not defer_head_logits("auto", 1, 1, 1, limit_elements) and defer_head_logits("auto", 1, 1, 1, limit_elements + 1)
    assert defer_head_logits("on", 1, 1, 1, 8) and not defer_head_logits("off", 8, 512, 7, 151_936)
    with pytest.raises(ValueError, match="chunked_head_loss.*auto, on or off"):
        defer_head_logits("yes", 1, 1, 1, 8)
    # the trainer's setting reaches the micro-batch the loss reads
    from types import SimpleNamespace

    from deepspec.algorithms.protocol import TrainBatch
    from deepspec.algorithms.registry import get_algorithm

    _, draft = make_draft()
    ids, lm = batch()
    b = TrainBatch(ids, lm, torch.zeros(2, 24, 64), torch.zeros(2, 24, 32), [0, 1])
    for setting, deferred in (("on", True), ("off", False), ("auto", False)):
        cfg = SimpleNamespace(num_anchors=4, chunked_head_loss=setting)
        assert get_algorithm("dspark").prepare(draft, b, torch.Generator().manual_seed(0), cfg).defer_logits is deferred


@pytest.mark.parametrize("defer", [False, True])
def test_a_micro_batch_without_supervised_slots_gives_every_head_parameter_a_zero_gradient(defer):
    """N = 0 (every block a padding block): loss 0, and every trainable parameter gets a gradient (zeros),
    deferred logits included; FSDP2 reduce-scatters only parameters with one, on every rank alike."""
    target, draft = make_draft("qwen3", seed=2, markov_head_type="gated")
    ids, lm = batch(B=2, S=24, seed=4)
    feats, last = capture(target, ids)
    ap = torch.zeros(2, 3, dtype=torch.long)
    valid = torch.zeros(2, 3, dtype=torch.bool)
    out = draft.forward_train(ids, feats, ap, valid, defer_logits=defer)
    res = dspark_loss(out, ids, lm, ap, valid, last, draft.target_lm_head_weight, draft.config)
    assert res.num_valid_slots == 0 and float(res.loss.detach()) == 0.0
    res.loss.backward()
    missing = [n for n, p in draft.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing
    assert all(float(p.grad.abs().sum()) == 0.0 for p in draft.parameters() if p.requires_grad)
