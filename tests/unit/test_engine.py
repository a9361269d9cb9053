"""SpeculativeEngine on a tiny random Llama target: lossless greedy output and cache bookkeeping."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.eval.engine import SpeculativeEngine, crop_kv_cache
from deepspec.eval.proposers import NullProposer, Proposal
from deepspec.target.capture import target_forward



pytestmark = pytest.mark.usefixtures("one_thread")


LAYER_IDS = [0]
VOCAB = 96
K = 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    # Sharpen the random logits so greedy decoding does not sit on near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


PROMPT = [0, 5, 17, 42, 8, 33, 71]


def hf_greedy(model, prompt, max_new_tokens, eos):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, len(prompt):].tolist()


class CheckingProposer:
    """Base for test proposers: checks the context invariant (features of exactly 0..p-1)."""

    max_proposal_len = K

    def __init__(self, feature_width: int):
        self.feature_width = feature_width
        self.num_context = 0
        self.tokens: list[int] = []
        self.num_calls = 0

    def reset(self):
        self.num_context = 0
        self.tokens = []  # the committed tokens at the positions whose features were received

    def extend_context(self, target_hidden_TF, token_ids_T):
        assert target_hidden_TF.dim() == 2 and target_hidden_TF.shape[1] == self.feature_width
        assert len(token_ids_T) == target_hidden_TF.shape[0]
        self.tokens.extend(token_ids_T)
        self.num_context += target_hidden_TF.shape[0]

    def propose(self, anchor_token, anchor_pos, *, temperature, generator):
        assert self.num_context == anchor_pos, (self.num_context, anchor_pos)
        self.num_calls += 1
        return self._propose(anchor_token, anchor_pos, temperature, generator)


class OracleProposer(CheckingProposer):
    """Proposes the target's own greedy continuation (precomputed with HF generate)."""

    def __init__(self, feature_width, full_sequence):
        super().__init__(feature_width)
        self.seq = full_sequence

    def _propose(self, anchor_token, anchor_pos, temperature, generator):
        assert self.seq[anchor_pos] == anchor_token
        ids = self.seq[anchor_pos + 1 : anchor_pos + 1 + K]
        probs = torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), VOCAB).float()
        return Proposal(draft_ids_N=torch.tensor(ids, dtype=torch.long), draft_probs_NV=probs)


class RandomProposer(CheckingProposer):
    def __init__(self, feature_width, seed=0):
        super().__init__(feature_width)
        self.gen = torch.Generator().manual_seed(seed)

    def _propose(self, anchor_token, anchor_pos, temperature, generator):
        n = int(torch.randint(0, K + 1, (1,), generator=self.gen))
        probs = torch.softmax(torch.randn(n, VOCAB, generator=self.gen) * 3, -1)
        ids = torch.multinomial(probs, 1, generator=self.gen)[:, 0] if n else torch.zeros(0, dtype=torch.long)
        return Proposal(draft_ids_N=ids, draft_probs_NV=probs)


class CacheCheckingForward:
    """Wraps target_forward; checks the KV cache holds exactly the committed positions before each call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, input_ids_BT, ids, *, position_ids_BT, past_key_values, **kw):
        start = int(position_ids_BT[0, 0])
        assert past_key_values.get_seq_length() == start, (past_key_values.get_seq_length(), start)
        self.calls += 1
        out = target_forward(model, input_ids_BT, ids, position_ids_BT=position_ids_BT,
                             past_key_values=past_key_values, **kw)
        assert out.past_key_values.get_seq_length() == start + input_ids_BT.shape[1]
        return out


def _engine(model, proposer, eos):
    return SpeculativeEngine(model, LAYER_IDS, proposer, [eos], forward_fn=CacheCheckingForward())


@pytest.mark.parametrize("kind", ["null", "oracle", "random"])
def test_greedy_matches_hf_generate(target, kind):
    max_new = 20
    eos = 1
    ref = hf_greedy(target, PROMPT, max_new + K + 1, eos)
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = {
        "null": lambda: NullProposer(),
        "oracle": lambda: OracleProposer(width, PROMPT + ref),
        "random": lambda: RandomProposer(width),
    }[kind]()
    engine = _engine(target, proposer, eos)
    res = engine.generate(PROMPT, max_new_tokens=max_new, temperature=0.0)
    assert res.output_ids == ref[:max_new]
    assert res.stop_reason in ("max_new_tokens", "eos")
    # every step commits accepted + 1 (no EOS here) and the bookkeeping adds up
    assert 1 + sum(s.num_committed for s in res.steps) >= len(res.output_ids)
    assert all(0 <= s.num_accepted <= s.num_proposed <= K for s in res.steps)
    assert engine.forward_fn.calls == len(res.steps) + 1
    if kind == "oracle":
        tau = sum(s.num_accepted + 1 for s in res.steps) / len(res.steps)
        assert tau == pytest.approx(K + 1)
    if kind == "null":
        assert len(res.steps) == max_new - 1 and all(s.num_proposed == 0 for s in res.steps)
    else:  # the proposer received the token at every position whose features it received
        assert proposer.tokens == (PROMPT + res.output_ids)[: len(proposer.tokens)]
        assert len(proposer.tokens) == proposer.num_context
    assert res.ttft_s > 0 and res.total_time_s >= res.ttft_s


@pytest.mark.parametrize("kind", ["null", "oracle", "random"])
def test_greedy_stops_at_eos_like_hf(target, kind):
    free = hf_greedy(target, PROMPT, 20, eos_token_id_unused())
    eos = free[6]  # make the 7th greedy token the EOS (first occurrence)
    ref = hf_greedy(target, PROMPT, 20, eos)
    assert ref[-1] == eos and len(ref) <= 7
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = {
        "null": lambda: NullProposer(),
        "oracle": lambda: OracleProposer(width, PROMPT + free + [0] * K),
        "random": lambda: RandomProposer(width, seed=3),
    }[kind]()
    res = _engine(target, proposer, eos).generate(PROMPT, max_new_tokens=20, temperature=0.0)
    assert res.output_ids == ref and res.stop_reason == "eos"


def eos_token_id_unused():
    return VOCAB + 1  # never produced: HF generate runs to max_new_tokens


def test_max_position_embeddings_truncates_and_stops(target):
    max_pos = target.config.max_position_embeddings
    prompt = PROMPT * 8  # 56 tokens, max positions 64
    width = target.config.hidden_size * len(LAYER_IDS)
    ref = hf_greedy(target, prompt, max_pos - len(prompt), eos_token_id_unused())
    proposer = OracleProposer(width, prompt + ref + [0] * (K + 2))
    res = _engine(target, proposer, eos_token_id_unused()).generate(prompt, max_new_tokens=100, temperature=0.0)
    assert res.stop_reason == "max_positions"
    # the last anchor sits at position max_pos (never fed); everything before was verified
    assert len(prompt) + len(res.output_ids) == max_pos + 1
    assert res.output_ids[:-1] == ref[: len(res.output_ids) - 1]
    assert all(len(prompt) + sum(s.num_accepted + 1 for s in res.steps[:i]) + s.num_proposed < max_pos
               for i, s in enumerate(res.steps))


def test_sampling_runs_and_is_reproducible(target):
    width = target.config.hidden_size * len(LAYER_IDS)
    outs = []
    for _ in range(2):
        res = _engine(target, RandomProposer(width, seed=5), eos_token_id_unused()).generate(
            PROMPT, max_new_tokens=12, temperature=0.8, generator=torch.Generator().manual_seed(11)
        )
        assert len(res.output_ids) == 12 and all(0 <= t < VOCAB for t in res.output_ids)
        outs.append(res.output_ids)
    assert outs[0] == outs[1]


def test_crop_kv_cache_refuses_uncroppable():
    class NoCrop:
        def get_seq_length(self):
            return 5

    with pytest.raises(RuntimeError, match="cannot be cropped"):
        crop_kv_cache(NoCrop(), 3)
    crop_kv_cache(NoCrop(), 5)  # nothing to do


def test_bad_arguments(target):
    engine = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([2] * 64, max_new_tokens=3)


class _FakeChatTokenizer:
    """Stand-in tokenizer: a 'chat template' mapping characters to ids (enough for render_prompt)."""

    chat_template = "fake"
    eos_token_id = VOCAB + 1  # never produced: every generation runs to max_new_tokens
    pad_token_id = 1

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [0] + [2 + (ord(c) % (VOCAB - 2)) for c in text]


def test_run_eval_end_to_end_writes_report(target, tmp_path):
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    width = target.config.hidden_size * len(LAYER_IDS)
    benches = {
        "tiny": [BenchmarkPrompt(id=f"p{i}", messages=[{"role": "user", "content": f"hello {i}"}]) for i in range(2)]
    }
    logs = []
    res = run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {"random": RandomProposer(width, seed=2)}, benches,
                   max_new_tokens=6, temperature=0.0, seed=0, out_dir=tmp_path, progress=False, log=logs.append)
    figs = res["benchmarks"]["tiny"]
    assert set(figs) == {"target-only", "random", "hf-generate"}
    assert figs["target-only"]["tau"] == 1.0
    assert figs["random"]["frac_identical_to_baseline"] == 1.0  # lossless at T=0
    assert figs["hf-generate"]["frac_identical_to_baseline"] == 1.0
    assert figs["random"]["speedup"] > 0 and figs["random"]["num_output_tokens"] == 12
    assert any("tiny" in line and "tau" in line for line in logs)
    for name in ("eval_results.json", "eval_report.md", "acceptance.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| tiny | random |" in (tmp_path / "eval_report.md").read_text()


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_low_temperature_sampling_matches_greedy(target, kind):
    """At T -> 0 the rejection-sampling path must reproduce greedy decoding: this checks that the
    verify rows (target p, draft q) are aligned with the draft tokens, at T > 0."""
    max_new = 16
    ref = hf_greedy(target, PROMPT, max_new + K + 1, eos_token_id_unused())
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = OracleProposer(width, PROMPT + ref) if kind == "oracle" else RandomProposer(width, seed=9)
    res = _engine(target, proposer, eos_token_id_unused()).generate(
        PROMPT, max_new_tokens=max_new, temperature=1e-4, generator=torch.Generator().manual_seed(0)
    )
    assert res.output_ids == ref[:max_new]
    if kind == "oracle":
        assert all(s.num_accepted == K for s in res.steps)


class _BigramTarget(torch.nn.Module):
    """A bigram "target": logits of the next token depend only on the current token (table row),
    exposed through the engine's interfaces (hidden = one-hot, lm_head = the table). Fast enough
    for a statistical test of the whole engine loop."""

    def __init__(self, table_VV):
        super().__init__()
        v = table_VV.shape[0]
        self.config = LlamaConfig(vocab_size=v, hidden_size=v, num_hidden_layers=1, num_attention_heads=1,
                                  max_position_embeddings=64)
        self.lm_head = torch.nn.Linear(v, v, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(table_VV.T)

    def get_output_embeddings(self):
        return self.lm_head


class _CountingCache:
    def __init__(self):
        self.n = 0

    def get_seq_length(self):
        return self.n

    def crop(self, k):
        assert k <= 0
        self.n += k


def _bigram_forward(model, input_ids_BT, ids, *, position_ids_BT, past_key_values, use_cache, compute_logits):
    from types import SimpleNamespace

    cache = past_key_values if isinstance(past_key_values, _CountingCache) else _CountingCache()
    assert cache.n == int(position_ids_BT[0, 0])
    cache.n += input_ids_BT.shape[1]
    hidden = torch.nn.functional.one_hot(input_ids_BT, model.config.vocab_size).float()
    return SimpleNamespace(target_hidden_BTF=hidden, target_last_hidden_BTH=hidden,
                           logits_BTV=model.lm_head(hidden) if compute_logits else None, past_key_values=cache)


def test_sampling_is_lossless_statistically():
    """T = 1: the marginal distributions of output tokens 2 and 3 (which go through verify steps)
    equal the target's own, whatever the draft proposes (here a fixed, badly skewed q)."""
    v, trials = 8, 1000
    table = torch.randn(v, v, generator=torch.Generator().manual_seed(3)) * 1.5
    trans_VV = torch.softmax(table, -1)
    q_V = torch.softmax(torch.arange(v, dtype=torch.float32) * 0.9, -1)

    class SkewedProposer:
        max_proposal_len = 2

        def reset(self):
            pass

        def extend_context(self, h, token_ids):
            pass

        def propose(self, anchor_token, anchor_pos, *, temperature, generator):
            ids = torch.multinomial(q_V, 2, replacement=True, generator=generator)
            return Proposal(draft_ids_N=ids, draft_probs_NV=q_V.expand(2, v).clone())

    engine = SpeculativeEngine(_BigramTarget(table), [0], SkewedProposer(), [v + 5], forward_fn=_bigram_forward)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, v)
    for _ in range(trials):
        out = engine.generate([1, 4], max_new_tokens=3, temperature=1.0, generator=gen).output_ids
        counts[0, out[1]] += 1
        counts[1, out[2]] += 1
    dist1 = trans_VV[4]
    for row, dist in enumerate((dist1 @ trans_VV, dist1 @ trans_VV @ trans_VV)):
        exp = dist * trials
        chi2 = float(((counts[row] - exp) ** 2 / exp).sum())
        dof = v - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (row, chi2, counts[row], exp)
        # the same statistic against the draft's q is far out: the test has power
        exp_q = q_V * trials
        assert float(((counts[row] - exp_q) ** 2 / exp_q).sum()) > 10 * (dof + 6 * (2 * dof) ** 0.5)


@pytest.mark.parametrize("use_heads", [True, False])
def test_dspark_proposer_through_engine_is_lossless(target, use_heads):
    """Integration with helper MODEL's DSparkProposer (untrained, random draft): greedy output equals
    HF generate, the context invariant holds, and T > 0 runs with valid draft probabilities."""
    config_mod = pytest.importorskip("deepspec.models.config")
    dspark_mod = pytest.importorskip("deepspec.models.dspark")
    from deepspec.eval.proposers import DSparkProposer

    layer_ids = [0]
    cfg = config_mod.draft_config_from_target(
        target.config, num_draft_layers=1, target_layer_ids=layer_ids, mask_token_id=VOCAB - 1, block_size=K,
        markov_rank=8, use_markov_head=use_heads, use_confidence_head=use_heads,
        **({} if use_heads else {"confidence_weight": 0.0}),
    )
    torch.manual_seed(0)
    draft = dspark_mod.DSparkDraftModel.from_target(target, cfg).float().eval()
    proposer = DSparkProposer(draft)
    max_new = 14
    ref = hf_greedy(target, PROMPT, max_new, eos_token_id_unused())
    engine = SpeculativeEngine(target, layer_ids, proposer, [eos_token_id_unused()], forward_fn=CacheCheckingForward())
    res = engine.generate(PROMPT, max_new_tokens=max_new, temperature=0.0)
    assert res.output_ids == ref
    assert all(s.num_proposed == K for s in res.steps)
    res = engine.generate(PROMPT, max_new_tokens=max_new, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(res.output_ids) == max_new


@pytest.mark.slow
def test_real_target_greedy_is_lossless_with_multi_token_verify():
    """The embedded default target (SmolLM2-135M, fp32): verify forwards over K+1 tokens and a
    cropped cache give exactly HF generate's greedy tokens, with random drafts (many rejections)
    and with the target's own continuation (all accepted: tau = K+1)."""
    from deepspec.data.chat import render_prompt
    from deepspec.target.capture import default_target_layer_ids
    from deepspec.target.load import load_target

    model, tok = load_target("default")
    ids = default_target_layer_ids(model.config.num_hidden_layers)
    prompt = render_prompt(tok, [{"role": "user", "content": "Name three primary colors."}])
    width = model.config.hidden_size * len(ids)
    max_new = 16
    ref = hf_greedy(model, prompt, max_new + K + 1, eos_token_id_unused())
    seq = prompt + ref
    v = model.config.vocab_size

    class RealRandom(CheckingProposer):
        gen = torch.Generator().manual_seed(0)

        def _propose(self, anchor_token, anchor_pos, temperature, generator):
            return Proposal(draft_ids_N=torch.randint(0, v, (K,), generator=self.gen))

    class RealOracle(CheckingProposer):
        def _propose(self, anchor_token, anchor_pos, temperature, generator):
            return Proposal(draft_ids_N=torch.tensor(seq[anchor_pos + 1 : anchor_pos + 1 + K]))

    for proposer in (RealRandom(width), RealOracle(width)):
        res = SpeculativeEngine(model, ids, proposer, [eos_token_id_unused()],
                                forward_fn=CacheCheckingForward()).generate(prompt, max_new_tokens=max_new)
        assert res.output_ids == ref[:max_new]
    assert all(s.num_accepted == K for s in res.steps)
