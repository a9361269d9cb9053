"""Draft trees: the Proposal form, tree verification, the tree mask, KV compaction, and the engine
lossless with tree proposers (a planted tree, DSpark's tree, prompt lookup beside the draft)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from deepspec.algorithms.ngram.proposer import LookupFirstProposer
from deepspec.algorithms.protocol import DraftTree, Proposal
from deepspec.decoding.engine import SpeculativeEngine, compact_kv_cache, target_tree_mask, tree_attention_mask
from deepspec.decoding.verify import SamplingParams, verify_greedy, verify_tree
from deepspec.target.capture import target_forward
from tests.unit.test_engine import (K, LAYER_IDS, PROMPT, VOCAB, CheckingProposer, eos_token_id_unused,  # noqa: F401
                                    gemma3_target, hf_greedy, target)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the Proposal form
def test_draft_tree_merges_shared_prefixes_and_keeps_siblings_distinct():
    tree = DraftTree()
    assert tree.add_path([5, 6, 7]) == [0, 1, 2]
    assert tree.add_path([5, 6, 9]) == [0, 1, 3]  # shares 5, 6
    assert tree.add_path([8]) == [4]
    tree.add_proposal(Proposal(draft_ids_N=torch.tensor([8, 2, 5]), parents_N=(-1, 0, -1)))  # 8 and 5 exist
    p = tree.to_proposal(max_proposal_len=3)
    assert p.draft_ids_N.tolist() == [5, 6, 7, 9, 8, 2]
    assert p.parents_N == (-1, 0, 1, 1, -1, 4)
    assert p.depths_N == [1, 2, 3, 3, 1, 2] and p.depth == 3 and p.num_proposed == 6


def test_proposal_tree_validation_names_the_field():
    with pytest.raises(ValueError, match=r"parents_N: expected one parent per draft token \(2\)"):
        Proposal(draft_ids_N=torch.tensor([1, 2]), parents_N=(-1,))
    with pytest.raises(ValueError, match=r"parents_N\[1\]: expected -1 \(the anchor\) or an earlier node"):
        Proposal(draft_ids_N=torch.tensor([1, 2]), parents_N=(-1, 1))
    with pytest.raises(ValueError, match=r"one per node \(\[2\]\)"):
        Proposal(draft_ids_N=torch.tensor([1, 2]), parents_N=(-1, 0), confidence_N=torch.ones(1))
    nan = float("nan")
    with pytest.raises(ValueError, match="one path from the anchor"):  # two scored nodes at depth 1
        Proposal(draft_ids_N=torch.tensor([1, 2]), parents_N=(-1, -1), confidence_N=torch.tensor([0.5, 0.4]))
    with pytest.raises(ValueError, match="one path from the anchor"):  # node 2 hangs from an unscored node
        Proposal(draft_ids_N=torch.tensor([1, 2, 3]), parents_N=(-1, -1, 1),
                 confidence_N=torch.tensor([0.5, nan, 0.4]))


def test_a_trees_scored_path_survives_a_subset():
    nan = float("nan")
    p = Proposal(draft_ids_N=torch.tensor([1, 2, 3, 4]), parents_N=(-1, -1, 0, 2),
                 confidence_N=torch.tensor([0.9, nan, 0.6, 0.3]))
    assert p.scored_path() == [0, 2, 3]
    assert p.node_scores() == [pytest.approx(0.9), None, pytest.approx(0.6), pytest.approx(0.3)]
    cut = p.subset([0, 1, 2])
    assert cut.scored_path() == [0, 2] and cut.confidence_N[[0, 2]].tolist() == pytest.approx([0.9, 0.6])
    assert Proposal(draft_ids_N=torch.tensor([1, 2]), confidence_N=torch.ones(2)).scored_path() == [0, 1]
    assert Proposal(draft_ids_N=torch.tensor([1]), parents_N=(-1,)).scored_path() == []
    assert Proposal(draft_ids_N=torch.tensor([1, 2])).node_scores() == [None, None]


def test_draft_tree_keeps_what_each_node_was_drawn_from():
    """At T > 0 a sampled node keeps its q and chosen nodes get point masses; a chosen copy merges into an
    existing node, a sampled copy may not (its rejection would change the residual)."""
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tree = DraftTree()
    tree.add_proposal(Proposal(draft_ids_N=torch.tensor([2, 3]), draft_probs_NV=torch.stack([q, q])))  # sampled
    tree.add_path([2, 0])  # a lookup's match: chosen, merging at 2
    tree.add(-1, 1, q)
    p = tree.to_proposal()
    assert p.draft_ids_N.tolist() == [2, 3, 0, 1] and p.parents_N == (-1, 0, 0, -1)
    assert p.draft_probs_NV.tolist() == [q.tolist(), q.tolist(), [1, 0, 0, 0], q.tolist()]
    with pytest.raises(ValueError, match="a sampled copy cannot merge"):
        tree.add(-1, 2, q)
    assert DraftTree().to_proposal().draft_probs_NV is None
    only_chosen = DraftTree()
    only_chosen.add_path([1, 2])
    assert only_chosen.to_proposal().draft_probs_NV is None


def test_truncated_cuts_chains_and_trees_by_depth():
    chain = Proposal(draft_ids_N=torch.tensor([4, 5, 6]), confidence_N=torch.tensor([0.9, 0.8, 0.7]))
    cut = chain.truncated(2)
    assert cut.draft_ids_N.tolist() == [4, 5] and cut.confidence_N.tolist() == pytest.approx([0.9, 0.8])
    assert chain.truncated(3) is chain and chain.truncated(-1).num_proposed == 0
    tree = Proposal(draft_ids_N=torch.tensor([1, 2, 3, 4, 5]), parents_N=(-1, 0, 1, -1, 3))
    cut = tree.truncated(1)
    assert cut.draft_ids_N.tolist() == [1, 4] and cut.parents_N == (-1, -1)
    cut = tree.truncated(2)
    assert cut.draft_ids_N.tolist() == [1, 2, 4, 5] and cut.parents_N == (-1, 0, -1, 2)
    probs = torch.eye(6)[[1, 2, 3, 4, 5]]  # a tree at T > 0: one row per node, cut with it
    cut = dataclasses.replace(tree, draft_probs_NV=probs).truncated(2)
    assert cut.draft_probs_NV.argmax(-1).tolist() == [1, 2, 4, 5]


# ----------------------------------------------------------------------------- greedy tree verification
def _logits_with_argmax(rows: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(len(rows)))
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
    return logits


def test_tree_verify_equals_chain_verify_on_chains():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(0, 5, (1,), generator=gen))
        drafts = torch.randint(0, 4, (n,), generator=gen)  # a small vocab: many accepts and EOS hits
        logits = torch.randn(n + 1, 4, generator=gen)
        chain = verify_greedy(drafts, logits, eos_token_ids={3})
        tree, path = verify_tree(drafts, tuple(range(-1, n - 1)), logits, eos_token_ids={3})
        assert tree == chain, trial
        assert path == list(range(chain.num_accepted))


def test_tree_verify_follows_the_branch_the_target_agrees_with():
    # anchor -> {7 -> {8, 9}, 6 -> {5}}; the target says 7, 9, then 11
    ids, parents = torch.tensor([7, 8, 6, 9, 5]), (-1, 0, -1, 0, 2)
    rows = [7, 9, 0, 0, 11, 0]  # row i+1 belongs to node i: node 0 (7) -> 9, node 3 (9) -> 11
    res, path = verify_tree(ids, parents, _logits_with_argmax(rows), eos_token_ids={1})
    assert path == [0, 3] and res.num_accepted == 2 and res.committed == [7, 9, 11] and not res.hit_eos
    rows = [6, 0, 0, 1, 0, 0]  # 6 accepted, then the target says EOS (1), not node 4's 5
    res, path = verify_tree(ids, parents, _logits_with_argmax(rows), eos_token_ids={1})
    assert path == [2] and res.committed == [6, 1] and res.hit_eos
    ids, parents = torch.tensor([1, 4]), (-1, 0)  # an accepted EOS ends the step there
    res, path = verify_tree(ids, parents, _logits_with_argmax([1, 4, 4]), eos_token_ids={1})
    assert path == [0] and res.committed == [1] and res.num_accepted == 1 and res.hit_eos
    with pytest.raises(ValueError, match="one parent per draft token"):
        verify_tree(ids, (-1,), _logits_with_argmax([1, 4, 4]), eos_token_ids={1})


def test_tree_attention_mask():
    mask = tree_attention_mask([-1, 0, -1, 2], past_len=2)[0, 0]
    assert mask.shape == (5, 7) and mask[:, :2].all()
    assert mask[:, 2:].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                          [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    chain = tree_attention_mask([-1, 0, 1], past_len=0)[0, 0]
    assert torch.equal(chain, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_sliding_window_tree_masks():
    """A sliding layer's row at position q sees keys at positions > q - W only (transformers' rule); a model
    with per-layer types gets a mask per type, one without them a windowed mask or a plain one."""
    full = tree_attention_mask([-1, 0, -1], past_len=3)[0, 0]
    slid = tree_attention_mask([-1, 0, -1], past_len=3, sliding_window=2)[0, 0]
    # rows: anchor (pos 3), node 0 (pos 4), node 1 (pos 5), node 2 (pos 4); key positions 0 1 2 | 3 4 5 4
    assert slid.int().tolist() == [[0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0],
                                   [0, 0, 0, 1, 0, 0, 1]]
    assert torch.equal(slid, full & slid)

    class Cfg:
        sliding_window = 2
        layer_types = ["sliding_attention", "full_attention"]

    masks = target_tree_mask(Cfg(), [-1, 0, -1], 3)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert torch.equal(masks["full_attention"][0, 0], full) and torch.equal(masks["sliding_attention"][0, 0], slid)
    Cfg.layer_types = None
    assert torch.equal(target_tree_mask(Cfg(), [-1, 0, -1], 3)[0, 0], slid)  # every layer slides
    Cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(RuntimeError, match="chunked_attention layers, which take no tree attention mask"):
        target_tree_mask(Cfg(), [-1], 3)


def test_gemma3_sliding_window_tree_decoding_matches_hf_generate(gemma3_target):
    """Gemma 3 with a window of 3 (every step crosses it): draft trees decode exactly HF's greedy output."""
    max_new = 20
    ref = hf_greedy(gemma3_target, PROMPT, max_new + K + 1, 1)
    width = gemma3_target.config.hidden_size * len(LAYER_IDS)
    forward = TreeForward()
    engine = SpeculativeEngine(gemma3_target, LAYER_IDS, PlantedTreeProposer(width, PROMPT + ref, [2, 0, K, 1]), [1],
                               forward_fn=forward)
    res = engine.generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref[:max_new] and forward.tree_calls == len(res.steps)
    assert sum(s.num_accepted for s in res.steps) > len(res.steps)


def test_tree_forward_and_compaction_equal_the_accepted_path_fed_as_a_chain(target):
    """One forward over [anchor, tree] under the tree mask gives each branch's logits, and after
    compact_kv_cache the cache equals the one a chain forward over the accepted path leaves."""
    cache = DynamicCache()
    target_forward(target, torch.tensor([PROMPT]), [], past_key_values=cache, use_cache=True)
    start = len(PROMPT)
    anchor, ids, parents = 3, [10, 11, 20, 21, 22], (-1, 0, -1, 2, 3)  # branches 10-11 and 20-21-22
    depths = Proposal(draft_ids_N=torch.tensor(ids), parents_N=parents).depths_N
    tree_cache = copy.deepcopy(cache)
    out = target_forward(target, torch.tensor([[anchor, *ids]]), LAYER_IDS, past_key_values=tree_cache,
                         use_cache=True, compute_logits=True,
                         position_ids_BT=torch.tensor([[start, *(start + d for d in depths)]]),
                         attention_mask_BT=tree_attention_mask(parents, start))
    for branch, rows in (([10, 11], [0, 1, 2]), ([20, 21, 22], [0, 3, 4, 5])):
        chain_cache = copy.deepcopy(cache)
        ref = target_forward(target, torch.tensor([[anchor, *branch]]), LAYER_IDS, past_key_values=chain_cache,
                             use_cache=True, compute_logits=True)
        torch.testing.assert_close(out.logits_BTV[0, rows], ref.logits_BTV[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.target_hidden_BTF[0, rows], ref.target_hidden_BTF[0], atol=1e-5, rtol=1e-5)
    compact_kv_cache(tree_cache, start, [0, 3, 4])  # accept 20, 21
    assert tree_cache.get_seq_length() == start + 3
    for got, want in zip(tree_cache.layers, chain_cache.layers):
        torch.testing.assert_close(got.keys, want.keys[:, :, : start + 3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values[:, :, : start + 3], atol=1e-5, rtol=1e-5)


def test_compact_kv_cache_refuses_a_cache_without_layer_tensors():
    class NoLayers:
        def get_seq_length(self):
            return 5

        def crop(self, n):
            pass

    with pytest.raises(RuntimeError, match="draft trees need a DynamicCache"):
        compact_kv_cache(NoLayers(), 2, [0, 2])


# ----------------------------------------------------------------------------- the engine with trees
class TreeForward:
    """The engine's forward, checking before each call that the cache holds exactly the committed positions."""

    def __init__(self):
        self.tree_calls = 0

    def __call__(self, model, input_ids_BT, ids, *, position_ids_BT, past_key_values, **kw):
        assert past_key_values.get_seq_length() == int(position_ids_BT[0, 0])
        self.tree_calls += kw.get("attention_mask_BT") is not None
        return target_forward(model, input_ids_BT, ids, position_ids_BT=position_ids_BT,
                              past_key_values=past_key_values, **kw)


class PlantedTreeProposer(CheckingProposer):
    """A tree of distractor branches with the target's greedy continuation planted on a branch cut after
    ``plan[i]`` tokens (step i), so a greedy step must accept exactly ``plan[i]`` whatever the branch order."""

    def __init__(self, feature_width, full_sequence, plan):
        super().__init__(feature_width)
        self.seq, self.plan = full_sequence, plan

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        j = self.plan[(self.num_calls - 1) % len(self.plan)]
        truth = [self.seq[p] if p < len(self.seq) else 0 for p in range(anchor_pos + 1, anchor_pos + 1 + K)]
        planted = truth[:j] + [(t + 1) % VOCAB for t in truth[j:]]
        wrong = [(t + 2) % VOCAB for t in truth]
        tree = DraftTree()
        for path in ((wrong, planted) if self.num_calls % 2 else (planted, wrong)):
            tree.add_path(path)
        tree.add_path(truth[:1] + [(t + 3) % VOCAB for t in truth[1:]])  # shares the first token
        return tree.to_proposal()


def test_engine_accepts_the_planted_branch_and_stays_lossless(target):
    max_new = 30
    ref = hf_greedy(target, PROMPT, max_new + K + 1, eos_token_id_unused())
    plan = [0, 3, 1, K, 2]
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = PlantedTreeProposer(width, PROMPT + ref, plan)
    forward = TreeForward()
    engine = SpeculativeEngine(target, LAYER_IDS, proposer, [eos_token_id_unused()], forward_fn=forward)
    res = engine.generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref[:max_new]
    assert [s.num_accepted for s in res.steps] == [max(plan[i % len(plan)], 1) for i in range(len(res.steps))]
    assert forward.tree_calls == len(res.steps)
    assert all(s.num_proposed == K and s.num_draft_nodes > K for s in res.steps)
    # the context the proposer saw is exactly the committed tokens
    assert proposer.tokens == (PROMPT + res.output_ids)[: len(proposer.tokens)]


def test_engine_verifies_trees_at_temperature_above_zero_reproducibly(target):
    """At T > 0 a tree is verified by the target's own draws (the distribution tests are in
    tests/integration/test_lossless_sampling.py): a seeded generator gives the same output twice."""
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = PlantedTreeProposer(width, PROMPT * 20, [1])
    engine = SpeculativeEngine(target, LAYER_IDS, proposer, [eos_token_id_unused()], forward_fn=TreeForward())
    hot = SamplingParams(temperature=1.0)
    runs = [engine.generate(PROMPT, max_new_tokens=12, sampling=hot, generator=torch.Generator().manual_seed(0))
            for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 12
    assert all(s.num_draft_nodes is not None for s in runs[0].steps)


def _dspark_draft(target, use_heads=True):
    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.model import DSparkDraftModel

    cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                   mask_token_id=VOCAB - 1, block_size=K, markov_rank=8,
                                   use_markov_head=use_heads, use_confidence_head=use_heads,
                                   **({} if use_heads else {"confidence_weight": 0.0}))
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, cfg).float().eval()


@pytest.mark.parametrize("use_heads", [True, False])  # DSpark; DFlash (no Markov head: the same logits per parent)
def test_dspark_tree_holds_the_chain_and_is_lossless(target, use_heads):
    from deepspec.algorithms.dspark.proposer import DSparkProposer

    draft = _dspark_draft(target, use_heads)
    chain, tree = DSparkProposer(draft), DSparkProposer(draft, tree_width=3)
    cache = DynamicCache()
    out = target_forward(target, torch.tensor([PROMPT]), LAYER_IDS, past_key_values=cache, use_cache=True)
    for p in (chain, tree):
        p.extend_context(out.target_hidden_BTF[0], PROMPT)
    greedy = SamplingParams()
    c = chain.propose(9, len(PROMPT), sampling=greedy, generator=None)
    t = tree.propose(9, len(PROMPT), sampling=greedy, generator=None)
    assert c.parents_N is None and t.parents_N is not None
    assert t.num_proposed == 3 * K and t.depth == K
    assert [t.depths_N.count(d) for d in range(1, K + 1)] == [3] * K
    node, path = -1, []  # the chain is a path of the tree
    for tok in c.draft_ids_N.tolist():
        node = next(i for i, (p, x) in enumerate(zip(t.parents_N, t.draft_ids_N.tolist())) if p == node and x == tok)
        path.append(node)
    assert len(path) == K
    top2 = SamplingParams(temperature=1.0, top_k=2)  # at T > 0 the tree is chosen within the filtered support
    sampled = tree.propose(9, len(PROMPT), sampling=top2, generator=torch.Generator().manual_seed(0))
    assert sampled.parents_N is not None and sampled.depth == K
    rows, ids = sampled.draft_probs_NV, sampled.draft_ids_N
    chosen = rows[torch.arange(len(ids)), ids] == 1  # point masses; the rest: the sampled chain, q rows
    assert int((~chosen).sum()) <= K and torch.allclose(rows.sum(-1), torch.ones(len(ids)))
    sampled_nodes = [i for i in range(len(ids)) if not chosen[i]]
    assert all(sampled.parents_N[b] == a for a, b in zip(sampled_nodes, sampled_nodes[1:]))  # one chain
    assert all(min(j for j, p in enumerate(sampled.parents_N) if p == sampled.parents_N[i]) == i
               for i in sampled_nodes)  # each tested first among its siblings
    assert [sampled.depths_N.count(d) for d in range(1, K + 1)] == [2] + [3] * (K - 1)
    assert max(sampled.parents_N.count(i) for i in range(-1, sampled.num_proposed)) == 2  # 2 survive top-k 2

    max_new = 20
    ref = hf_greedy(target, PROMPT, max_new, eos_token_id_unused())
    engine = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(draft, tree_width=3), [eos_token_id_unused()],
                               forward_fn=TreeForward())
    chain_engine = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(draft), [eos_token_id_unused()])
    res, chain_res = engine.generate(PROMPT, max_new_tokens=max_new), chain_engine.generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref == chain_res.output_ids
    assert all(s.num_draft_nodes == 3 * K for s in res.steps if s.num_proposed == K)


def test_dspark_tree_width_errors(target):
    from deepspec.algorithms.dspark.proposer import DSparkProposer

    draft = _dspark_draft(target)
    with pytest.raises(ValueError, match=r"tree_width: expected an integer >= 1"):
        DSparkProposer(draft, tree_width=0)
    with pytest.raises(ValueError, match="not cut by confidence"):
        DSparkProposer(draft, tree_width=2, confidence_threshold=0.5)


class FixedChainDraft(CheckingProposer):
    """A draft that always proposes the same wrong chain."""

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        return Proposal(draft_ids_N=torch.tensor([VOCAB - 2] * K))


def test_lookup_beside_the_draft_verifies_both_and_is_lossless(target):
    width = target.config.hidden_size * len(LAYER_IDS)
    prompt = PROMPT + PROMPT[1:] + PROMPT[1:]  # repeated text: the lookup matches
    max_new = 24
    ref = hf_greedy(target, prompt, max_new, eos_token_id_unused())
    both = LookupFirstProposer(FixedChainDraft(width), vocab_size=VOCAB, ngram_min=1, tree=True)
    engine = SpeculativeEngine(target, LAYER_IDS, both, [eos_token_id_unused()], forward_fn=TreeForward())
    res = engine.generate(prompt, max_new_tokens=max_new)
    assert res.output_ids == ref
    with_match = [s for s in res.steps if s.num_draft_nodes is not None]
    assert with_match and both.steps_from_lookup == len(with_match)
    assert all(s.num_draft_nodes > K for s in with_match)  # the match and the draft's chain, both verified
    # at T > 0 too, the match and the draft's (sampled) chain are verified side by side
    both.reset()
    both.extend_context(torch.zeros(len(prompt) - 1, width), prompt[:-1])
    p = both.propose(prompt[-1], len(prompt) - 1, sampling=SamplingParams(temperature=1.0), generator=None)
    assert p.parents_N is not None and p.num_proposed > K and p.draft_probs_NV is None


def test_the_report_says_which_methods_verify_trees(target):
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.eval.report import _tree_note
    from deepspec.eval.run import _proposer_info

    width = target.config.hidden_size * len(LAYER_IDS)
    tree = DSparkProposer(_dspark_draft(target), tree_width=3)
    info = _proposer_info(LookupFirstProposer(tree, vocab_size=VOCAB, tree=True))
    assert info["tree_width"] == 3 and info["lookup_tree"] is True
    assert _tree_note(info) == " (draft tree 3 per slot, match verified beside the draft)"
    info = _proposer_info(LookupFirstProposer(FixedChainDraft(width), vocab_size=VOCAB))
    assert "tree_width" not in info and info["lookup_tree"] is False and _tree_note(info) == ""
