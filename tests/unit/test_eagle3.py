"""Eagle3: model shapes, TTT loss rules, train/inference consistency, save/load, the trainer,
and lossless speculative decoding through the engine. Tiny random Llama targets only.

Legend: B batch, S seq, K ttt steps, H hidden, F feature width, V vocab.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.eagle3 import Eagle3Algorithm
from deepspec.algorithms.eagle3.config import Eagle3Config, eagle3_config_from_target
from deepspec.algorithms.eagle3.loss import eagle3_loss, ttt_supervision
from deepspec.algorithms.eagle3.model import Eagle3DraftModel, ttt_masks
from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
from deepspec.algorithms.protocol import NullProposer
from deepspec.algorithms.registry import algorithm_for_model, get_algorithm, load_draft
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams
from deepspec.target.capture import target_forward

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
LAYER_IDS = [0, 1]
EOS = 1


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=EOS,
                      pad_token_id=EOS)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharpen the random logits: no near-ties in greedy decoding
        model.lm_head.weight.mul_(8.0)
    return model.requires_grad_(False)


def make_draft(target, seed=1, steps=7):
    cfg = eagle3_config_from_target(target.config, target_layer_ids=LAYER_IDS, ttt_steps=steps)
    torch.manual_seed(seed)
    return Eagle3DraftModel.from_target(target, cfg)


def features(target, ids_BS):
    out = target_forward(target, ids_BS, LAYER_IDS)
    return out.target_hidden_BTF.float(), out.target_last_hidden_BTH.float()


def sample(target, S=20, seed=0, prompt=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (1, S), generator=g)
    lm = torch.ones(1, S, dtype=torch.long)
    lm[:, :prompt] = 0
    feats, last = features(target, ids)
    return ids, lm, feats, last


# ----------------------------------------------------------------------------- shapes and rules
def test_shapes_config_and_masks(target):
    d = make_draft(target)
    c = d.config
    assert (c.feature_width, c.ttt_steps, c.step_decay, c.family) == (64, 7, 0.8, "llama")
    assert Eagle3Config.from_dict(c.to_dict()) == c
    assert d.fc.weight.shape == (32, 64)
    assert d.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 64)  # reads [embed ; hidden] = 2H
    assert d.midlayer.self_attn.k_proj.weight.shape == (2 * 8, 64)
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
    assert torch.equal(d.lm_head.weight, target.lm_head.weight)
    ids, lm, feats, last = sample(target, S=12)
    outs = d.forward_train(ids.expand(2, -1), feats.expand(2, -1, -1))
    assert len(outs) == 7 and all(o.shape == (2, 12, 32) for o in outs)
    m = ttt_masks(5, 3)
    assert [tuple(x.shape) for x in m] == [(5, 5), (5, 10), (5, 15)]
    assert torch.equal(m[2][:, 5:10], torch.eye(5, dtype=torch.bool)) and torch.equal(m[0], m[2][:, :5])
    assert m[0][1, 0] and not m[0][0, 1]


def test_step_weights_decay_and_shifted_mask():
    lm = torch.ones(2, 10, dtype=torch.long)
    lm[1, 6:] = 0  # a right-padded sample of length 6
    valid, w = ttt_supervision(lm, 4, 0.8)
    for k in range(4):
        assert torch.allclose(w[k][valid[k]], torch.full_like(w[k][valid[k]], 0.8 ** k))
        assert int(valid[k, 0].sum()) == 10 - k - 2  # row t predicts t+k+2 < S
        assert int(valid[k, 1].sum()) == max(0, 6 - k - 2)
    assert valid[1, 0, 6] and not valid[1, 0, 7]  # step 1: t + 3 < 10
    lm2 = torch.ones(1, 10, dtype=torch.long)
    lm2[0, 5] = 0
    valid2, _ = ttt_supervision(lm2, 3, 0.8)
    assert not valid2[0, 0, 3] and not valid2[2, 0, 1] and valid2[2, 0, 2]  # position 5 never a label


def test_loss_invariant_to_padding_and_global_normalisation(target):
    d = make_draft(target)
    ids, lm, feats, last = sample(target, S=20)
    base = eagle3_loss(d, ids, lm, feats, last)
    pad = 9
    ids_p = torch.cat([ids, torch.randint(2, V, (1, pad))], 1)
    lm_p = torch.cat([lm, torch.zeros(1, pad, dtype=torch.long)], 1)
    feats_p = torch.cat([feats, torch.randn(1, pad, feats.shape[-1])], 1)
    last_p = torch.cat([last, torch.randn(1, pad, last.shape[-1])], 1)
    padded = eagle3_loss(d, ids_p, lm_p, feats_p, last_p)
    assert torch.allclose(base.loss, padded.loss, atol=1e-5), (base.loss, padded.loss)
    assert base.num_supervised_K == padded.num_supervised_K
    # two samples in one batch, global normaliser = the weighted mean over both samples
    ids2, lm2, feats2, last2 = sample(target, S=29, seed=3)
    both = eagle3_loss(d, torch.cat([ids_p, ids2]), torch.cat([lm_p, lm2]), torch.cat([feats_p, feats2]),
                       torch.cat([last_p, last2]))
    w1 = ttt_supervision(lm, 7, 0.8)[1].sum()
    w2 = ttt_supervision(lm2, 7, 0.8)[1].sum()
    second = eagle3_loss(d, ids2, lm2, feats2, last2)
    expect = (base.loss * w1 + second.loss * w2) / (w1 + w2)
    assert torch.allclose(both.loss, expect, atol=1e-5)
    both.loss.backward()
    assert d.fc.weight.grad is not None and d.embed_tokens.weight.grad is None
    s = both.scalars()
    assert {"loss", "num_supervised"} <= set(s)
    # the pooled acceptance counts add up over samples: the batch's counts are the two samples' sums
    a1 = eagle3_loss(d, ids_p, lm_p, feats_p, last_p).acceptance
    a2 = eagle3_loss(d, ids2, lm2, feats2, last2).acceptance
    assert torch.allclose(both.acceptance.pack(), (a1 + a2).pack(), atol=1e-6)
    assert 1.0 <= both.tau_estimate <= 8 and 1.0 <= both.greedy_tau_estimate <= 8


def test_training_forward_matches_inference_chain(target):
    """Row t of TTT step k equals chain step k after committing rows 0..t (teacher-forced tokens), whether
    the rows are committed at once (a request's prompt: the causal kernel, no mask) or after earlier ones."""
    d = make_draft(target).eval()
    ids, lm, feats, last = sample(target, S=16)
    with torch.no_grad():
        outs = d.forward_train(ids, feats)
    for t in (0, 4, 8):
        at_once = d.commit_rows(d.new_cache(), ids[0, 1:t + 2], feats[0, :t + 1])
        assert torch.allclose(at_once, outs[0][0, :t + 1], atol=1e-5), t
        cache = d.new_cache()
        split = min(2, t)  # commit rows 0..split-1 first, then the rest: exercises the cached path
        if split:
            d.commit_rows(cache, ids[0, 1:split + 1], feats[0, :split])
        h = d.commit_rows(cache, ids[0, split + 1:t + 2], feats[0, split:t + 1])[-1]
        assert torch.allclose(h, outs[0][0, t], atol=1e-5)
        ck, cv = [], []
        for k in range(1, 5):
            h = d.tree_step(cache, ck, cv, ids[0, t + 1 + k].view(1), h.view(1, -1), t + k)[0]
            assert torch.allclose(h, outs[k][0, t], atol=1e-5), (t, k)


def test_tree_step_equals_a_chain_along_each_path(target):
    """Nodes of one depth drafted together, each seeing only its ancestors' steps (``visible_XM``), give the
    outputs a chain along that node's path gives: a tree of 2 nodes at depth 1 and 3 at depth 2."""
    d = make_draft(target).eval()
    ids, lm, feats, last = sample(target, S=16)
    cache = d.new_cache()
    h0 = d.commit_rows(cache, ids[0, 1:9], feats[0, :8])[-1]  # rows 0..7; the drafted tokens follow position 8
    a, b, a1, a2, b1 = 11, 12, 13, 14, 15
    sk, sv = [], []
    h1 = d.tree_step(cache, sk, sv, torch.tensor([a, b]), torch.stack([h0, h0]), 8)  # no earlier steps
    visible = torch.tensor([[True, False], [True, False], [False, True]])  # a1, a2 under a; b1 under b
    h2 = d.tree_step(cache, sk, sv, torch.tensor([a1, a2, b1]), h1[[0, 0, 1]], 9, visible)
    for path, want in (((a,), h1[0]), ((b,), h1[1]), ((a, a1), h2[0]), ((a, a2), h2[1]), ((b, b1), h2[2])):
        ck, cv, h = [], [], h0
        for j, tok in enumerate(path):
            h = d.tree_step(cache, ck, cv, torch.tensor([tok]), h.view(1, -1), 8 + j)[0]
        assert torch.allclose(h, want, atol=1e-5), path


def test_chain_rows_forward_equals_the_all_rows_forward(target):
    """forward_train(rows_BS=...) computes only the sampled chains' rows; their states at every step, the
    loss and the gradients equal the all-rows forward's (two sequences of different lengths and chain
    counts, chains near the end included); the other rows are 0."""
    d = make_draft(target, steps=4)
    (ids1, lm1, f1, l1), (ids2, lm2, f2, l2) = sample(target, S=20), sample(target, S=20, seed=5)
    ids, lm, feats, last = (torch.cat(x) for x in ((ids1, ids2), (lm1, lm2), (f1, f2), (l1, l2)))
    lm[1, 15:] = 0  # a shorter second sequence
    rows = torch.zeros(2, 20, dtype=torch.bool)
    rows[0, [4, 9, 16, 17]] = True
    rows[1, [6, 13]] = True
    with torch.no_grad():
        dense, sparse = d.forward_train(ids, feats), d.forward_train(ids, feats, rows_BS=rows)
    for k in range(4):
        assert torch.allclose(sparse[k][rows], dense[k][rows], atol=1e-5), k
        assert torch.count_nonzero(sparse[k][~rows]) == 0
    grads = []
    for use_rows in (False, True):
        d.zero_grad(set_to_none=True)
        if not use_rows:  # the loss with the all-rows forward under the same chain supervision
            d.forward_train = lambda ids_, f_, steps=None, rows_BS=None: Eagle3DraftModel.forward_train(d, ids_, f_)
        out = eagle3_loss(d, ids, lm, feats, last, rows_BS=rows)
        vars(d).pop("forward_train", None)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (loss_all, g_all), (loss_rows, g_rows) = grads
    assert torch.allclose(loss_all, loss_rows, atol=1e-6)
    assert g_all.keys() == g_rows.keys() and "fc.weight" in g_all
    for name in g_all:
        assert torch.allclose(g_all[name], g_rows[name], atol=1e-5), name


def test_save_load_round_trip_and_registry(target, tmp_path):
    d = make_draft(target, steps=3)
    with torch.no_grad():
        d.fc.weight.add_(0.5)
    d.save_pretrained(tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["deepspec_algorithm"] == "eagle3" and cfg["eagle3_config"]["ttt_steps"] == 3
    name, loaded = load_draft(tmp_path / "draft")
    assert name == "eagle3" and isinstance(loaded, Eagle3DraftModel) and loaded.config == d.config
    a, b = d.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(algorithm_for_model(loaded), Eagle3Algorithm)
    assert isinstance(get_algorithm("eagle3").proposer(loaded), Eagle3Proposer)
    assert not get_algorithm("dspark").owns(loaded)


# ----------------------------------------------------------------------------- engine
def _engine(target, proposer):
    return SpeculativeEngine(target, LAYER_IDS, proposer, [EOS])


PROMPTS = [[0, 5, 17, 42, 8, 33, 71], [0, 9, 9, 9], [0, 60, 2, 77, 31, 14, 15, 92, 6, 40, 41]]


def _greedy_data(target, prompt, n):
    out = _engine(target, NullProposer()).generate(prompt, max_new_tokens=n)
    return prompt + out.output_ids


@pytest.fixture(scope="module")
def trained_draft(target):
    """A draft trained on the target's own greedy continuations of the prompts (repetitive data)."""
    d = make_draft(target, steps=4)
    seqs = [_greedy_data(target, p, 40) for p in PROMPTS]
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first = last = None
    d.train()
    for step in range(80):
        total = 0.0
        for s in seqs:
            ids = torch.tensor([s])
            lm = torch.ones_like(ids)
            feats, lasth = features(target, ids)
            out = eagle3_loss(d, ids, lm, feats, lasth)
            out.loss.backward()
            total += float(out.loss.detach())
        opt.step()
        opt.zero_grad()
        first = total if first is None else first
        last = total
    assert last < first
    return d.eval()


@pytest.mark.parametrize("which", ["random", "trained"])
def test_engine_lossless_greedy(target, trained_draft, which):
    draft = make_draft(target) if which == "random" else trained_draft
    accepted = 0
    for prompt in PROMPTS:
        ref = _engine(target, NullProposer()).generate(prompt, max_new_tokens=30)
        res = _engine(target, Eagle3Proposer(draft)).generate(prompt, max_new_tokens=30)
        assert res.output_ids == ref.output_ids, prompt
        assert all(s.num_proposed == draft.config.ttt_steps for s in res.steps[:-1])
        accepted += sum(s.num_accepted for s in res.steps)
    if which == "trained":
        assert accepted > 0  # tau > 1 on data like the training data


def test_engine_sampling_and_position_cap(target, trained_draft):
    from deepspec.decoding.verify import SamplingParams

    g = torch.Generator().manual_seed(0)
    res = _engine(target, Eagle3Proposer(trained_draft, k=3)).generate(PROMPTS[0], max_new_tokens=12,
                                                                       sampling=SamplingParams(temperature=0.8),
                                                                       generator=g)
    assert 1 <= len(res.output_ids) <= 12 and all(s.num_proposed <= 3 for s in res.steps)
    p = Eagle3Proposer(trained_draft, max_positions=12)
    ref = _engine(target, NullProposer()).generate(PROMPTS[0], max_new_tokens=30)
    res = _engine(target, p).generate(PROMPTS[0], max_new_tokens=30)
    assert res.output_ids == ref.output_ids
    with pytest.raises(ValueError, match="token ids"):
        Eagle3Proposer(trained_draft).extend_context(torch.zeros(2, 64), [1])


@pytest.mark.parametrize("which", ["random", "trained"])
def test_tree_holds_the_chain_and_engine_stays_lossless(target, trained_draft, which):
    """A greedy tree of 3 per depth contains the chain the chain proposer drafts (so a step accepts at least
    as much), has 3 nodes at every depth, and decoding with trees gives the target's greedy output."""
    draft = make_draft(target, steps=4).eval() if which == "random" else trained_draft
    K = draft.config.ttt_steps
    prompt = PROMPTS[0]
    feats, _ = features(target, torch.tensor([prompt]))
    chain, tree = Eagle3Proposer(draft), Eagle3Proposer(draft, tree_width=3)
    greedy = SamplingParams()
    for p in (chain, tree):
        p.extend_context(feats[0, :-1], prompt[:-1])
    c = chain.propose(prompt[-1], len(prompt) - 1, sampling=greedy, generator=None)
    t = tree.propose(prompt[-1], len(prompt) - 1, sampling=greedy, generator=None)
    assert c.parents_N is None and t.parents_N is not None and t.draft_probs_NV is None
    assert [t.depths_N.count(d) for d in range(1, K + 1)] == [3] * K
    node = -1
    for tok in c.draft_ids_N.tolist():  # the chain is a path of the tree
        node = next(i for i, (p, x) in enumerate(zip(t.parents_N, t.draft_ids_N.tolist())) if p == node and x == tok)
    accepted = 0
    for prompt in PROMPTS:
        ref = _engine(target, NullProposer()).generate(prompt, max_new_tokens=30)
        res = _engine(target, Eagle3Proposer(draft, tree_width=3)).generate(prompt, max_new_tokens=30)
        assert res.output_ids == ref.output_ids, prompt
        assert all(s.num_draft_nodes == 3 * K for s in res.steps if s.num_proposed == K)
        accepted += sum(s.num_accepted for s in res.steps)
    if which == "trained":
        assert accepted > 0


def test_every_tree_node_is_what_a_chain_along_its_path_would_score(target):
    """Each depth of a greedy tree keeps the chain's node and the W - 1 best other children by summed
    log-probability, where every kept node's children are scored by a chain run along that node's path (one
    row per step, no mask): so the tree's batched steps see exactly each node's own ancestors, off the chain too."""
    W, draft = 3, make_draft(target, steps=4).eval()
    prompt = PROMPTS[2]
    feats, _ = features(target, torch.tensor([prompt]))
    proposer = Eagle3Proposer(draft, tree_width=W)
    proposer.extend_context(feats[0, :-1], prompt[:-1])
    t = proposer.propose(prompt[-1], len(prompt) - 1, sampling=SamplingParams(), generator=None)
    h0, pos0 = proposer.last_hidden, len(prompt) - 1

    @torch.no_grad()
    def logp_below(path):  # the draft's log-probabilities after the tokens of ``path``, by a chain run
        ck, cv, h = [], [], h0
        for j, tok in enumerate(path):
            h = draft.tree_step(proposer.cache, ck, cv, torch.tensor([tok]), h.view(1, -1), pos0 + j)[0]
        return torch.log_softmax(draft.logits(h).float(), dim=-1)

    ids, parents = t.draft_ids_N.tolist(), t.parents_N
    chain_nodes = {min(i for i, d in enumerate(t.depths_N) if d == depth) for depth in range(1, t.depth + 1)}
    assert any(p >= 0 and p not in chain_nodes for p in parents)  # branches off the chain are checked too
    paths, scores = {-1: []}, {-1: 0.0}
    for i, (p, tok) in enumerate(zip(parents, ids)):
        paths[i] = paths[p] + [tok]
    kept = [-1]
    for depth in range(1, t.depth + 1):
        level = [i for i in range(len(ids)) if t.depths_N[i] == depth]
        cand = {(p, tok): scores[p] + float(lp) for p in kept for tok, lp in enumerate(logp_below(paths[p]).tolist())}
        chain = level[0]  # the chain's node: the argmax below the previous depth's chain node
        assert ids[chain] == max((c for c in cand if c[0] == kept[0]), key=cand.get)[1]
        for i in level:
            scores[i] = cand[(parents[i], ids[i])]
        best_others = sorted((v for c, v in cand.items() if c != (parents[chain], ids[chain])), reverse=True)
        assert [scores[i] for i in level[1:]] == pytest.approx(best_others[: W - 1], abs=1e-4), depth
        kept = level


def test_tree_at_temperature_above_zero_and_with_a_reduced_vocabulary(target):
    """At T > 0 (top-k 2) the tree's one sampled path carries its q rows over target ids (only draft-vocabulary
    ids), every other node is a chosen point mass listed after its sampled sibling; the width is checked."""
    draft = reduced_eagle3(target, torch.arange(0, V, 2))
    prompt = PROMPTS[2]
    feats, _ = features(target, torch.tensor([prompt]))
    proposer = Eagle3Proposer(draft, k=3, tree_width=3)
    proposer.extend_context(feats[0, :-1], prompt[:-1])
    t = proposer.propose(prompt[-1], len(prompt) - 1, sampling=SamplingParams(temperature=1.0, top_k=2),
                         generator=torch.Generator().manual_seed(0))
    ids, rows = t.draft_ids_N, t.draft_probs_NV
    assert set(ids.tolist()) <= set(range(0, V, 2)) and float(rows[:, 1::2].sum()) == 0.0
    chosen = rows[torch.arange(len(ids)), ids] == 1
    sampled = [i for i in range(len(ids)) if not chosen[i]]
    assert len(sampled) == 3 and all(t.parents_N[b] == a for a, b in zip(sampled, sampled[1:]))  # one path
    assert all(min(j for j, p in enumerate(t.parents_N) if p == t.parents_N[i]) == i for i in sampled)
    assert [t.depths_N.count(d) for d in (1, 2, 3)] == [2, 3, 3]  # top-k 2 leaves 2 children of the anchor
    with pytest.raises(ValueError, match=r"Eagle3Proposer.tree_width: expected an integer >= 1"):
        Eagle3Proposer(draft, tree_width=0)


# ----------------------------------------------------------------------------- trainer
def test_trainer_lowers_the_loss(tmp_path):
    from deepspec.data.cache import write_target_cache_from_samples
    from deepspec.target.load import target_fingerprint, tokenizer_fingerprint
    from deepspec.train.config import TrainConfig
    from deepspec.train.loop import train
    from tests.helpers import tiny_llama_target
    from tests.unit.test_chat import tiny_chatml_tokenizer

    tok = tiny_chatml_tokenizer()
    model = tiny_llama_target(tok)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(4):
        ids = torch.randint(4, len(tok), (30,), generator=gen).tolist()
        samples.append((f"s{i}", ids, [0] * 8 + [1] * 22))
    cache = tmp_path / "cache"
    write_target_cache_from_samples(samples, cache, model, target_layer_ids=LAYER_IDS,
                                    target_fingerprint=target_fingerprint(model),
                                    tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32",
                                    progress=False)
    out = tmp_path / "run"
    ckpt = train(TrainConfig(cache_dir=str(cache), output_dir=str(out), algorithm="eagle3", batch_size=2,
                             ttt_steps=3, max_steps=10, lr=1e-2, warmup_frac=0.1), target_model=model,
                 tokenizer=tok)
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]
    assert "accept_rate_prefix_1" in rows[0] and "tau_estimate" in rows[0] and "greedy_tau_estimate" in rows[0]
    name, draft = load_draft(ckpt / "draft")
    assert name == "eagle3" and draft.config.ttt_steps == 3


def test_prepare_samples_chain_starts_within_the_supervision_budget():
    from deepspec.algorithms.eagle3.config import Eagle3Options
    from deepspec.algorithms.protocol import TrainBatch

    B, S = 2, 40
    lm = torch.zeros(B, S, dtype=torch.long)
    lm[0, 5:30] = 1
    lm[1, 10:14] = 1  # only 2 rows whose step-0 target (t + 2) is supervised
    batch = TrainBatch(torch.zeros(B, S, dtype=torch.long), lm, torch.zeros(B, S, 4), torch.zeros(B, S, 2), [0, 1])
    algo = Eagle3Algorithm()
    gen = torch.Generator().manual_seed(0)
    prepared = algo.prepare(None, batch, gen, Eagle3Options(num_chains=6))
    valid0 = ttt_supervision(lm, 1, 1.0)[0][0]
    assert prepared.rows_BS.sum(1).tolist() == [6, 4]  # capped at 6; all 4 candidates of row 1 kept
    assert not (prepared.rows_BS & ~valid0).any()  # only rows whose first prediction is supervised
    again = algo.prepare(None, batch, torch.Generator().manual_seed(0), Eagle3Options(num_chains=6))
    assert torch.equal(prepared.rows_BS, again.rows_BS)  # a pure function of the generator state
    assert algo.prepare(None, batch, gen, Eagle3Options(num_chains=0)).rows_BS is None
    full = ttt_supervision(lm, 7, 0.8)[1]
    sub = ttt_supervision(lm, 7, 0.8, prepared.rows_BS)[1]
    assert 0 < sub.sum() < full.sum() and torch.all(sub <= full)


# ----------------------------------------------------------------------------- reduced draft vocabulary
def reduced_eagle3(target, d2t, seed=1):
    cfg = eagle3_config_from_target(target.config, target_layer_ids=LAYER_IDS, ttt_steps=3,
                                    draft_vocab_size=None if d2t is None else int(d2t.numel()))
    torch.manual_seed(seed)
    return Eagle3DraftModel.from_target(target, cfg, d2t=d2t)


def test_reduced_vocab_shapes_save_load_and_bad_map(target, tmp_path):
    from safetensors.torch import load_file, save_file

    d2t = torch.arange(0, V, 3)
    draft = reduced_eagle3(target, d2t)
    assert draft.lm_head.weight.shape == (d2t.numel(), 32) and torch.equal(draft.lm_head.weight,
                                                                            target.lm_head.weight[d2t])
    draft.save_pretrained(tmp_path / "d")
    name, loaded = load_draft(tmp_path / "d")
    assert name == "eagle3" and torch.equal(loaded.d2t, d2t) and loaded.config.draft_vocab_size == d2t.numel()
    weights = tmp_path / "d" / "model.safetensors"
    save_file({**load_file(str(weights)), "d2t": torch.cat([d2t[:-1], torch.tensor([V])])}, str(weights))
    with pytest.raises(ValueError, match="d2t.*target ids in"):
        Eagle3DraftModel.from_pretrained(tmp_path / "d")


@torch.no_grad()
def slow_reduced_soft_ce(draft, target, ids, lm, feats, last, d2t):
    """Row by row: -sum over draft tokens of p_target[d2t[d]] log p_draft[d], weight decay^k."""
    c = draft.config
    outs = draft.forward_train(ids, feats)
    valid, w = ttt_supervision(lm, c.ttt_steps, c.step_decay)
    total = 0.0
    for k in range(c.ttt_steps):
        for b, t in valid[k].nonzero().tolist():
            logp_W = torch.log_softmax(draft.logits(outs[k][b, t]).double(), -1)
            pt_V = torch.softmax((last[b, t + k + 1] @ target.lm_head.weight.T).double(), -1)
            total += float(w[k, b, t]) * -float((pt_V[d2t] * logp_W).sum())
    return total / float(w.sum())


def test_reduced_vocab_loss_matches_slow_version_and_identity_equals_full(target):
    ids, lm, feats, last = sample(target, S=14)
    d2t = torch.arange(1, V, 2)
    draft = reduced_eagle3(target, d2t)
    out = eagle3_loss(draft, ids, lm, feats, last, chunk_rows=3)
    assert float(out.loss.detach()) == pytest.approx(slow_reduced_soft_ce(draft, target, ids, lm, feats, last, d2t),
                                                     rel=1e-4)
    full, ident = reduced_eagle3(target, None), reduced_eagle3(target, torch.arange(V))
    a, b = eagle3_loss(full, ids, lm, feats, last), eagle3_loss(ident, ids, lm, feats, last)
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-6) and torch.equal(a.acc_K, b.acc_K)


def test_reduced_vocab_engine_lossless_greedy_and_target_ids(target):
    d2t = torch.arange(0, V, 2)
    draft = reduced_eagle3(target, d2t)
    prompt = torch.randint(2, V, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    base = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [EOS]).generate(prompt, max_new_tokens=20)
    proposer = Eagle3Proposer(draft)
    spec = SpeculativeEngine(target, LAYER_IDS, proposer, [EOS]).generate(prompt, max_new_tokens=20)
    assert spec.output_ids == base.output_ids and sum(s.num_proposed for s in spec.steps) > 0
    proposer.reset()
    feats, _ = features(target, torch.tensor([prompt]))
    proposer.extend_context(feats[0, :-1], prompt[:-1])
    sampled = proposer.propose(prompt[-1], len(prompt) - 1, sampling=SamplingParams(temperature=1.0),
                               generator=torch.Generator().manual_seed(0))
    assert set(sampled.draft_ids_N.tolist()) <= set(d2t.tolist())
    assert sampled.draft_probs_NV.shape[1] == V and float(sampled.draft_probs_NV[:, 1::2].sum()) == 0.0


def test_max_len_drafts_the_chain_s_prefix_and_a_shallower_tree(target, trained_draft):
    """Eagle3 drafts one token per draft forward (``drafts_serially``): ``max_len`` stops the chain (a tree's
    depth) there, and what it drafts is the whole proposal's prefix."""
    prompt = PROMPTS[0]
    feats, _ = features(target, torch.tensor([prompt]))
    greedy = SamplingParams()

    def propose(width, **kw):
        p = Eagle3Proposer(trained_draft, tree_width=width)
        p.extend_context(feats[0, :-1], prompt[:-1])
        return p.propose(prompt[-1], len(prompt) - 1, sampling=greedy, generator=None, **kw)

    assert Eagle3Proposer.drafts_serially
    whole, two = propose(1), propose(1, max_len=2)
    assert two.draft_ids_N.tolist() == whole.draft_ids_N.tolist()[:2]
    assert max(propose(3, max_len=2).depths_N) == 2
    with pytest.raises(ValueError, match="max_len"):
        propose(1, max_len=0)


def test_auto_schedule_drafts_the_planned_depth_and_stays_lossless(target, trained_draft, tmp_path, monkeypatch):
    """With the scheduler on, the engine asks a serial drafter for the depth it planned (drafting deeper only
    to cut it would be paid for nothing), and decoding stays the target's greedy decoding."""
    from deepspec.decoding.schedule import AcceptanceEstimator, StepCostCurve, StepScheduler

    class Recording(Eagle3Proposer):
        def propose(self, *args, max_len=None, **kw):
            self.asked.append(max_len)
            return super().propose(*args, max_len=max_len, **kw)

    proposer = Recording(trained_draft)
    proposer.asked = []
    sched = StepScheduler(StepCostCurve((1, 8), (0.01, 0.014)), serial_draft=True)
    sched.estimator = AcceptanceEstimator(first_prior=0.6)
    planned = []
    plan = sched.plan
    sched.plan = lambda k, pending=0, width=1: (planned.append(plan(k, pending, width) and sched.depth_limit)
                                                or planned[-1])
    for prompt in PROMPTS:
        ref = _engine(target, NullProposer()).generate(prompt, max_new_tokens=30)
        res = SpeculativeEngine(target, LAYER_IDS, proposer, [EOS], schedule=sched).generate(prompt, max_new_tokens=30)
        assert res.output_ids == ref.output_ids, prompt
        assert all(s.num_drafted <= max(proposer.asked) for s in res.steps)
    assert proposer.asked == [d for d in planned if d]  # every call got the depth its plan chose
    assert min(proposer.asked) < trained_draft.config.ttt_steps  # and a plan chose less than the whole chain
