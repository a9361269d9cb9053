"""SpeculativeEngine on a tiny random Llama target: lossless greedy output, KV cache rollback, the
position limit, the feature-less baseline, step timing, and run_eval (one and two turns)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.protocol import NullProposer, Proposal
from deepspec.decoding.engine import SpeculativeEngine, crop_kv_cache
from deepspec.decoding.verify import SamplingParams
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

    def prepare(self, num_positions):
        pass

    def reset(self):
        self.num_context = 0
        self.tokens = []  # the committed tokens at the positions whose features were received

    def extend_context(self, target_hidden_TF, token_ids_T):
        assert target_hidden_TF.dim() == 2 and target_hidden_TF.shape[1] == self.feature_width
        assert len(token_ids_T) == target_hidden_TF.shape[0]
        self.tokens.extend(token_ids_T)
        self.num_context += target_hidden_TF.shape[0]

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        assert isinstance(sampling, SamplingParams)
        assert self.num_context == anchor_pos, (self.num_context, anchor_pos)
        self.num_calls += 1
        return self._propose(anchor_token, anchor_pos, sampling, generator)


class OracleProposer(CheckingProposer):
    """Proposes the target's own greedy continuation (precomputed with HF generate)."""

    def __init__(self, feature_width, full_sequence):
        super().__init__(feature_width)
        self.seq = full_sequence

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        assert self.seq[anchor_pos] == anchor_token
        ids = self.seq[anchor_pos + 1 : anchor_pos + 1 + K]
        probs = torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), VOCAB).float()
        return Proposal(draft_ids_N=torch.tensor(ids, dtype=torch.long), draft_probs_NV=probs)


class RandomProposer(CheckingProposer):
    def __init__(self, feature_width, seed=0):
        super().__init__(feature_width)
        self.gen = torch.Generator().manual_seed(seed)

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        n = int(torch.randint(0, K + 1, (1,), generator=self.gen))
        probs = torch.softmax(torch.randn(n, VOCAB, generator=self.gen) * 3, -1)
        ids = torch.multinomial(probs, 1, generator=self.gen)[:, 0] if n else torch.zeros(0, dtype=torch.long)
        return Proposal(draft_ids_N=ids, draft_probs_NV=probs)


class CacheCheckingForward:
    """Wraps the engine's forward; before each call checks the KV cache holds exactly the committed
    positions (the rollback invariant) and that no position id reaches max_position_embeddings."""

    def __init__(self):
        self.calls = 0
        self.layer_ids: list[list[int]] = []  # the layer ids of each call ([] = no features asked)
        self.max_pos_fed = -1
        self.cache = None  # the cache of the latest generate() call

    def __call__(self, model, input_ids_BT, ids, *, position_ids_BT, past_key_values, **kw):
        start = int(position_ids_BT[0, 0])
        assert past_key_values.get_seq_length() == start, (past_key_values.get_seq_length(), start)
        assert position_ids_BT.tolist() == [list(range(start, start + input_ids_BT.shape[1]))]
        assert int(position_ids_BT.max()) < model.config.max_position_embeddings, position_ids_BT
        self.max_pos_fed = max(self.max_pos_fed, int(position_ids_BT.max()))
        self.calls += 1
        self.layer_ids.append(list(ids))
        out = target_forward(model, input_ids_BT, ids, position_ids_BT=position_ids_BT,
                             past_key_values=past_key_values, **kw)
        assert out.past_key_values.get_seq_length() == start + input_ids_BT.shape[1]
        assert (out.target_hidden_BTF is None) == (not ids)
        self.cache = out.past_key_values
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
    res = engine.generate(PROMPT, max_new_tokens=max_new)
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
        assert engine.forward_fn.layer_ids == [[]] * engine.forward_fn.calls  # no feature capture
    else:
        assert engine.forward_fn.layer_ids == [LAYER_IDS] * engine.forward_fn.calls
    if kind != "null":  # the proposer received the token at every position whose features it received
        assert proposer.tokens == (PROMPT + res.output_ids)[: len(proposer.tokens)]
        assert len(proposer.tokens) == proposer.num_context
    assert res.ttft_s > 0 and res.total_time_s >= res.ttft_s


@pytest.fixture(scope="module")
def gemma3_target():
    """Gemma 3 with sliding-window layers of window 3 beside a global one, and final-logit soft-capping:
    every prompt and every rollback crosses the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                           sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           final_logit_softcapping=5.0, tie_word_embeddings=False, max_position_embeddings=64,
                           bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = Gemma3ForCausalLM(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("kind", ["null", "oracle", "random"])
def test_gemma3_sliding_window_greedy_matches_hf_generate(gemma3_target, kind):
    """The engine keeps full KV layers (croppable) and the attention mask applies the window: greedy
    decoding equals HF generate (whose cache keeps only the window) with any proposer, and the window
    changes the output (so it is applied, not ignored)."""
    max_new = 20
    ref = hf_greedy(gemma3_target, PROMPT, max_new + K + 1, 1)
    width = gemma3_target.config.hidden_size * len(LAYER_IDS)
    proposer = {"null": lambda: NullProposer(), "oracle": lambda: OracleProposer(width, PROMPT + ref),
                "random": lambda: RandomProposer(width)}[kind]()
    res = _engine(gemma3_target, proposer, 1).generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref[:max_new]
    assert len(set(res.output_ids)) > 3  # not a degenerate repetition
    if kind == "random":
        assert any(s.num_accepted < s.num_proposed for s in res.steps)  # rollbacks happened
    windowless = type(gemma3_target)(type(gemma3_target.config)(**{**gemma3_target.config.to_dict(),
                                                                  "sliding_window": 64})).eval()
    windowless.load_state_dict(gemma3_target.state_dict())
    assert hf_greedy(windowless, PROMPT, max_new, 1) != ref[:max_new]


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
    res = _engine(target, proposer, eos).generate(PROMPT, max_new_tokens=20, sampling=SamplingParams())
    assert res.output_ids == ref and res.stop_reason == "eos"


def eos_token_id_unused():
    return VOCAB + 1  # never produced: HF generate runs to max_new_tokens


class PlannedProposer(CheckingProposer):
    """Always proposes K tokens (it ignores the position limit): the first ``plan[i]`` of step ``i`` are
    the target's greedy continuation, the rest are wrong, so a greedy step accepts exactly ``plan[i]``
    of K (fewer only where the position limit truncates). ``confidence_N`` is one value per slot."""

    def __init__(self, feature_width, full_sequence, plan):
        super().__init__(feature_width)
        self.seq, self.plan = full_sequence, plan

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        j = self.plan[(self.num_calls - 1) % len(self.plan)]
        ids = [self.seq[p] if p < len(self.seq) else 0 for p in range(anchor_pos + 1, anchor_pos + 1 + K)]
        ids = ids[:j] + [(t + 1) % VOCAB for t in ids[j:]]
        probs = torch.softmax(torch.randn(K, VOCAB, generator=torch.Generator().manual_seed(anchor_pos)), -1)
        return Proposal(draft_ids_N=torch.tensor(ids), draft_probs_NV=probs,
                        confidence_N=torch.linspace(0.9, 0.1, K))


class RollbackCheckingProposer:
    """Wraps a proposer; at each propose(anchor_pos=p) asserts the target cache holds exactly the
    committed positions 0..p-1 (p positions), i.e. the previous step's rollback was exact."""

    def __init__(self, inner, forward):
        self.inner, self.forward = inner, forward
        self.max_proposal_len = inner.max_proposal_len
        self.cache_lens: list[int] = []

    def prepare(self, num_positions):
        self.inner.prepare(num_positions)

    def reset(self):
        self.inner.reset()

    def extend_context(self, target_hidden_TF, token_ids_T):
        self.inner.extend_context(target_hidden_TF, token_ids_T)

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        self.cache_lens.append(self.forward.cache.get_seq_length())
        assert self.cache_lens[-1] == anchor_pos, (self.cache_lens[-1], anchor_pos)
        return self.inner.propose(anchor_token, anchor_pos, sampling=sampling, generator=generator)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20)])
def test_kv_cache_holds_exactly_the_committed_length_after_every_step(target, sampling):
    """A steps with a accepted of k proposed (a = 0..K planned at T=0, whatever verify gives at T>0):
    after each, the target cache holds exactly the committed positions (prompt + sum(a + 1))."""
    max_new = 30
    ref = hf_greedy(target, PROMPT, max_new + K + 1, eos_token_id_unused())
    width = target.config.hidden_size * len(LAYER_IDS)
    plan = [0, 3, 1, K, 2, 0]
    forward = CacheCheckingForward()
    proposer = RollbackCheckingProposer(PlannedProposer(width, PROMPT + ref, plan), forward)
    engine = SpeculativeEngine(target, LAYER_IDS, proposer, [eos_token_id_unused()], forward_fn=forward)
    res = engine.generate(PROMPT, max_new_tokens=max_new, sampling=sampling, generator=torch.Generator().manual_seed(1))
    committed = len(PROMPT) + sum(s.num_accepted + 1 for s in res.steps)
    assert proposer.cache_lens == [committed - sum(s.num_accepted + 1 for s in res.steps[i:])
                                   for i in range(len(res.steps))]
    assert forward.cache.get_seq_length() == committed  # the last step's rollback too
    assert all(s.num_proposed == K for s in res.steps)
    if sampling.greedy:
        assert res.output_ids == ref[:max_new]
        assert [s.num_accepted for s in res.steps] == [plan[i % len(plan)] for i in range(len(res.steps))]
    else:
        assert {s.num_accepted for s in res.steps} - {K}  # some steps rolled back


class _NoCropCache(DynamicCache):
    """A DynamicCache that reports ``is_croppable`` False (like a sliding-window / linear-attention /
    quantized cache, which cannot be rolled back)."""

    @property
    def is_croppable(self):
        return False


class _SilentNoCropCache(DynamicCache):
    """Claims to crop but keeps every position: the engine must notice, not continue on a stale cache."""

    def crop(self, tokens_to_remove):
        pass


def _swap_cache(cache_cls):
    def forward(model, input_ids_BT, ids, *, position_ids_BT, past_key_values, **kw):
        if int(position_ids_BT[0, 0]) == 0:  # prefill: the engine's fresh DynamicCache -> cache_cls
            past_key_values = cache_cls()
        return target_forward(model, input_ids_BT, ids, position_ids_BT=position_ids_BT,
                              past_key_values=past_key_values, **kw)
    return forward


def test_rollback_fails_loudly_on_a_cache_that_cannot_crop(target):
    width = target.config.hidden_size * len(LAYER_IDS)
    eos = [eos_token_id_unused()]
    spec = SpeculativeEngine(target, LAYER_IDS, RandomProposer(width), eos, forward_fn=_swap_cache(_NoCropCache))
    with pytest.raises(RuntimeError, match="cannot be cropped"):
        spec.generate(PROMPT, max_new_tokens=8)  # refused after the prefill, before any rejection
    silent = SpeculativeEngine(target, LAYER_IDS, PlannedProposer(width, PROMPT, [0]), eos,
                               forward_fn=_swap_cache(_SilentNoCropCache))
    with pytest.raises(RuntimeError, match="after crop the KV cache holds"):
        silent.generate(PROMPT, max_new_tokens=8)
    # target-only decoding never rolls back: any cache will do
    plain = SpeculativeEngine(target, LAYER_IDS, NullProposer(), eos, forward_fn=_swap_cache(_NoCropCache))
    assert len(plain.generate(PROMPT, max_new_tokens=5).output_ids) == 5


@pytest.mark.parametrize("room", [1, 2, 3, K, K + 1, K + 5])
def test_long_prompt_never_indexes_past_max_positions_and_stays_lossless(target, room):
    """A prompt ``room`` positions short of max_position_embeddings, a proposer that always proposes
    K tokens: every position id fed is < max_position_embeddings (checked in the forward), proposals
    shrink to what fits and then stop, and the output equals target-only greedy decoding."""
    max_pos = target.config.max_position_embeddings
    prompt = (PROMPT * 10)[: max_pos - room]
    width = target.config.hidden_size * len(LAYER_IDS)
    eos = [eos_token_id_unused()]
    plain_fwd = CacheCheckingForward()
    base = SpeculativeEngine(target, LAYER_IDS, NullProposer(), eos, forward_fn=plain_fwd).generate(
        prompt, max_new_tokens=100)
    ref = hf_greedy(target, prompt, room + 1, eos[0])
    forward = CacheCheckingForward()
    proposer = PlannedProposer(width, prompt + ref, [K, 2, 0, K])
    res = SpeculativeEngine(target, LAYER_IDS, proposer, eos, forward_fn=forward).generate(prompt, max_new_tokens=100)
    for r, fwd in ((base, plain_fwd), (res, forward)):
        assert r.stop_reason == "max_positions"
        # the last anchor would sit at position max_pos (never fed); every earlier one was verified
        assert len(prompt) + len(r.output_ids) == max_pos + 1
        assert fwd.max_pos_fed == max_pos - 1
    assert res.output_ids == base.output_ids == ref[: len(res.output_ids)]
    anchor = len(prompt)
    for s in res.steps:  # speculation shortens to what fits, then stops (N = 0 at the last position)
        assert s.num_proposed == min(K, max_pos - 1 - anchor)
        assert s.confidence is not None and len(s.confidence) == s.num_proposed
        anchor += s.num_accepted + 1
    if room <= K:  # the first proposal is cut to the room left (none at all with room 1)
        assert res.steps[0].num_proposed == room - 1
    # T > 0 obeys the same limit
    out = SpeculativeEngine(target, LAYER_IDS, PlannedProposer(width, prompt + ref, [1]), eos,
                            forward_fn=CacheCheckingForward()).generate(
        prompt, max_new_tokens=100, sampling=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0))
    assert out.stop_reason == "max_positions" and len(prompt) + len(out.output_ids) == max_pos + 1


def test_step_records_time_and_confidence(target):
    import time as _time

    width = target.config.hidden_size * len(LAYER_IDS)
    ref = hf_greedy(target, PROMPT, 20, eos_token_id_unused())

    class Slow(PlannedProposer):
        def _propose(self, *args):
            _time.sleep(0.003)
            return super()._propose(*args)

    res = _engine(target, Slow(width, PROMPT + ref, [1, K]), eos_token_id_unused()).generate(PROMPT, max_new_tokens=12)
    assert res.steps
    for s in res.steps:
        assert s.propose_s >= 0.003 and s.verify_s > 0
        assert s.propose_s + s.verify_s <= s.time_s
        assert s.confidence == pytest.approx(tuple(torch.linspace(0.9, 0.1, K).tolist()))
    base = _engine(target, NullProposer(), eos_token_id_unused()).generate(PROMPT, max_new_tokens=5)
    assert all(s.confidence is None and s.verify_s > 0 and s.propose_s >= 0 for s in base.steps)


def test_baseline_reads_no_features(target):
    """A proposer that can never propose (K = 0) gets no features: no capture, no extend_context."""

    class Blind:
        max_proposal_len = 0

        def prepare(self, num_positions):
            pass

        def reset(self):
            pass

        def extend_context(self, target_hidden_TF, token_ids_T):
            raise AssertionError("extend_context called for a proposer that proposes nothing")

        def propose(self, anchor_token, anchor_pos, *, sampling, generator):
            return Proposal.empty()

    forward = CacheCheckingForward()
    res = SpeculativeEngine(target, LAYER_IDS, Blind(), [eos_token_id_unused()], forward_fn=forward).generate(
        PROMPT, max_new_tokens=10)
    assert forward.layer_ids == [[]] * 10
    assert res.output_ids == hf_greedy(target, PROMPT, 10, eos_token_id_unused())



def test_a_generation_keeps_one_set_of_feature_hooks_and_hands_on_the_committed_features(target, monkeypatch):
    """With the default target forward, the capture hooks are added once per generation (not per step) and
    removed after it, and the proposer receives, position by position, the features one forward over the
    whole committed sequence gives (chains of accepted and rejected drafts alike)."""
    from deepspec.target import capture

    class Recording(RandomProposer):
        def reset(self):
            super().reset()
            self.feats = []

        def extend_context(self, target_hidden_TF, token_ids_T):
            super().extend_context(target_hidden_TF, token_ids_T)
            self.feats.append(target_hidden_TF.clone())

    added = []
    real_add = capture._add_capture_hooks
    monkeypatch.setattr(capture, "_add_capture_hooks", lambda *a: added.append(list(a[1])) or real_add(*a))
    proposer = Recording(target.config.hidden_size * len(LAYER_IDS), seed=3)
    res = SpeculativeEngine(target, LAYER_IDS, proposer, [eos_token_id_unused()]).generate(PROMPT, max_new_tokens=12)
    assert len(res.steps) > 3 and added == [LAYER_IDS]
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in target.model.layers)
    seq = PROMPT + res.output_ids
    got = torch.cat(proposer.feats)
    full = target_forward(target, torch.tensor([seq[: got.shape[0]]]), LAYER_IDS).target_hidden_BTF[0]
    assert proposer.tokens == seq[: got.shape[0]]
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_sampling_runs_and_is_reproducible(target):
    width = target.config.hidden_size * len(LAYER_IDS)
    outs = []
    for _ in range(2):
        res = _engine(target, RandomProposer(width, seed=5), eos_token_id_unused()).generate(
            PROMPT, max_new_tokens=12, sampling=SamplingParams(temperature=0.8),
            generator=torch.Generator().manual_seed(11)
        )
        assert len(res.output_ids) == 12 and all(0 <= t < VOCAB for t in res.output_ids)
        outs.append(res.output_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["null", "random"])
def test_top_k_one_sampling_is_greedy(target, kind):
    """T > 0 with top_k = 1: the first token (from the prefill logits) and every verify step sample
    from sampling_probs, a one-hot on the argmax, so the output equals greedy even at T = 5."""
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = NullProposer() if kind == "null" else RandomProposer(width, seed=4)
    ref = hf_greedy(target, PROMPT, 14, eos_token_id_unused())
    res = _engine(target, proposer, eos_token_id_unused()).generate(
        PROMPT, max_new_tokens=14, sampling=SamplingParams(temperature=5.0, top_k=1),
        generator=torch.Generator().manual_seed(0))
    assert res.output_ids == ref


def test_crop_kv_cache_refuses_uncroppable():
    class NoCrop:
        def get_seq_length(self):
            return 5

    with pytest.raises(RuntimeError, match="cannot be cropped"):
        crop_kv_cache(NoCrop(), 3)
    crop_kv_cache(NoCrop(), 5)  # nothing to do
    with pytest.raises(RuntimeError, match="cannot grow"):
        crop_kv_cache(NoCrop(), 6)


def test_bad_arguments(target):
    engine = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([2] * 64, max_new_tokens=3)
    with pytest.raises(ValueError, match="sampling"):
        engine.generate(PROMPT, max_new_tokens=3, sampling=0.5)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SpeculativeEngine(target, LAYER_IDS, NullProposer(), [])


class _FakeChatTokenizer:
    """Stand-in tokenizer: a 'chat template' mapping characters to ids (enough for render_prompt),
    ``decode`` mapping ids back to letters; records every conversation it renders."""

    chat_template = "fake"
    eos_token_id = VOCAB + 1  # never produced: every generation runs to max_new_tokens
    pad_token_id = 1

    def __init__(self):
        self.rendered: list[list[dict[str, str]]] = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        self.rendered.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [0] + [2 + (ord(c) % (VOCAB - 2)) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i in (0, 1)))


def test_run_eval_alternates_the_method_order_per_prompt(target, tmp_path, monkeypatch):
    """Methods run target-only first on even prompts and last on odd ones (ABBA), so a drift of the machine
    within a round weighs on every method alike; each method's results still come back in prompt order."""
    from deepspec.eval import run as run_mod
    from deepspec.eval.benchmarks import BenchmarkPrompt

    width = target.config.hidden_size * len(LAYER_IDS)
    calls = []
    real = run_mod._generate_or_explain

    def recording(run, engine, prompt_ids, generator, *, where):
        calls.append(where)
        return real(run, engine, prompt_ids, generator, where=where)

    monkeypatch.setattr(run_mod, "_generate_or_explain", recording)
    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(f"hello {i}",)) for i in range(3)]}
    proposers = {"a": RandomProposer(width, seed=2), "b": RandomProposer(width, seed=3)}
    res = run_mod.run_eval(target, _FakeChatTokenizer(), LAYER_IDS, proposers, benches, max_new_tokens=4,
                           sampling=SamplingParams(), seed=0, out_dir=None, progress=False, warmup=False,
                           compare_hf_generate=False, log=lambda _: None)
    assert calls == [f"tiny prompt p{i}, {name}" for i, names in enumerate(
        [("target-only", "a", "b"), ("b", "a", "target-only"), ("target-only", "a", "b")]) for name in names]
    tok = _FakeChatTokenizer()
    rendered = [tok.decode(tok.apply_chat_template([{"role": "user", "content": f"hello {i}"}], add_generation_prompt=True))
                for i in range(3)]
    for name in ("target-only", "a", "b"):
        assert [r["prompt"] for r in res["samples"]["tiny"][name]] == rendered


def test_run_eval_keeps_the_fastest_of_repeated_runs_each_from_the_same_state(target, tmp_path, monkeypatch):
    """With timing_repeats 2 each method runs a prompt twice, the second time in the reverse order, both from the
    scheduler state the prompt started with; the faster run is the one reported, and the next prompt starts from
    the state that run left."""
    import copy
    import dataclasses

    from deepspec.decoding.settings import DecodeSettings
    from deepspec.eval import run as run_mod
    from deepspec.eval.benchmarks import BenchmarkPrompt

    monkeypatch.setenv("DEEPSPEC_CACHE_DIR", str(tmp_path))
    width = target.config.hidden_size * len(LAYER_IDS)
    calls, seen = [], []
    real = run_mod._generate_or_explain
    fake_seconds = iter(range(100, 0, -1))  # every run is faster than the one before...

    def recording(run, engine, prompt_ids, generator, *, where):
        calls.append(where)
        before = copy.deepcopy(engine.scheduler)
        res = real(run, engine, prompt_ids, generator, where=where)
        seconds = float(next(fake_seconds)) if "p1" not in where else 1000.0 + len(calls)  # ...but on p1, slower
        after = copy.deepcopy(engine.scheduler)
        seen.append((where, before, after, seconds))
        return dataclasses.replace(res, total_time_s=seconds)

    monkeypatch.setattr(run_mod, "_generate_or_explain", recording)
    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(f"hello {i}",)) for i in range(3)]}
    res = run_mod.run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {"a": RandomProposer(width, seed=2)}, benches,
                           settings=DecodeSettings(schedule="auto"), max_new_tokens=6, sampling=SamplingParams(),
                           seed=0, out_dir=None, progress=False, warmup=False, compare_hf_generate=False,
                           log=lambda _: None, timing_repeats=2)
    assert calls == [f"tiny prompt p{i}, {name}" for i, names in enumerate(
        [("target-only", "a", "a", "target-only"), ("a", "target-only", "target-only", "a"),
         ("target-only", "a", "a", "target-only")]) for name in names]
    runs_a = [s for s in seen if s[0].endswith(", a")]
    for first, second in zip(runs_a[::2], runs_a[1::2]):
        assert first[1] == second[1]  # both repeats start from the same state
    kept = [min(pair, key=lambda s: s[3]) for pair in zip(runs_a[::2], runs_a[1::2])]
    assert [k is pair[1] for k, pair in zip(kept, zip(runs_a[::2], runs_a[1::2]))] == [True, False, True]
    for k, nxt in zip(kept, runs_a[2::2]):
        assert nxt[1] == k[2] and nxt[1] is not None  # the next prompt starts from the state the kept run left
    assert res["benchmarks"]["tiny"]["a"]["total_time_s"] == pytest.approx(sum(k[3] for k in kept))
    assert res["config"]["timing_repeats"] == 2
    with pytest.raises(ValueError, match="timing_repeats"):
        run_mod.run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {}, benches, max_new_tokens=6,
                         sampling=SamplingParams(), seed=0, out_dir=None, timing_repeats=0)


def test_run_eval_starts_every_benchmark_from_no_acceptance_history(target, tmp_path, monkeypatch):
    """A benchmark's first prompt meets a scheduler with no acceptance counts, whichever benchmarks ran before it
    (the warm-up and the first benchmark taught it some); the timings it measured carry over."""
    import copy

    from deepspec.decoding.settings import DecodeSettings
    from deepspec.eval import run as run_mod
    from deepspec.eval.benchmarks import BenchmarkPrompt

    monkeypatch.setenv("DEEPSPEC_CACHE_DIR", str(tmp_path))
    width = target.config.hidden_size * len(LAYER_IDS)
    seen = []
    real = run_mod._generate_or_explain

    def recording(run, engine, prompt_ids, generator, *, where):
        if where.endswith(", a"):
            seen.append((where, copy.deepcopy(engine.scheduler)))
        res = real(run, engine, prompt_ids, generator, where=where)
        if engine.scheduler is not None:  # what a draft that pays here would teach (the tiny one is never worth it)
            engine.scheduler.estimator.observe(1, 0, None, True)
        return res

    monkeypatch.setattr(run_mod, "_generate_or_explain", recording)
    benches = {b: [BenchmarkPrompt(id=f"p{i}", turns=(f"{b} {i}",)) for i in range(2)] for b in ("one", "two")}
    run_mod.run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {"a": RandomProposer(width, seed=2)}, benches,
                     settings=DecodeSettings(schedule="auto"), max_new_tokens=8, sampling=SamplingParams(), seed=0,
                     out_dir=None, progress=False, warmup=True, compare_hf_generate=False, log=lambda _: None)
    assert [w for w, _ in seen] == ["one prompt p0, a", "one prompt p1, a", "two prompt p0, a", "two prompt p1, a"]
    first_of, second_of = {w.split()[0]: s for w, s in seen[::2]}, {w.split()[0]: s for w, s in seen[1::2]}
    for bench in ("one", "two"):
        assert first_of[bench].estimator.cells == {} and first_of[bench].rate == 0.0
        assert second_of[bench].estimator.cells and second_of[bench].rate > 0  # its first prompt taught it
    assert first_of["one"].num_observed > 0 and first_of["one"].propose_s > 0  # the warm-up's timings, kept
    assert first_of["two"].num_observed > second_of["one"].num_observed


def test_run_eval_end_to_end_writes_report(target, tmp_path):
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    width = target.config.hidden_size * len(LAYER_IDS)
    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(f"hello {i}",)) for i in range(2)]}
    logs = []
    res = run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {"random": RandomProposer(width, seed=2)}, benches,
                   max_new_tokens=6, sampling=SamplingParams(), seed=0, out_dir=tmp_path, progress=False,
                   log=logs.append)
    figs = res["benchmarks"]["tiny"]
    assert set(figs) == {"target-only", "random", "hf-generate"}
    assert figs["target-only"]["tau"] == 1.0
    assert figs["random"]["frac_identical_to_baseline"] == 1.0  # lossless at T=0
    assert figs["hf-generate"]["frac_identical_to_baseline"] == 1.0
    assert figs["random"]["speedup"] > 0 and figs["random"]["num_output_tokens"] == 12
    assert "speedup_first_turn" not in figs["random"]  # one turn: the speedup is already over first turns
    assert res["config"]["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert [r["turn"] for r in res["samples"]["tiny"]["random"]] == [1, 1]
    # each record holds the rendered prompt and the generated text (readable back from the JSON)
    tok = _FakeChatTokenizer()
    written = json.loads((tmp_path / "eval_results.json").read_text())["samples"]["tiny"]
    for name in ("target-only", "random", "hf-generate"):
        for i, record in enumerate(res["samples"]["tiny"][name]):
            ids = tok.apply_chat_template([{"role": "user", "content": f"hello {i}"}], add_generation_prompt=True)
            assert record["prompt"] == tok.decode(ids) and record["prompt_len"] == len(ids)
            assert isinstance(record["output"], str) and len(record["output"]) <= record["num_new_tokens"]
            assert record["output"] == res["samples"]["tiny"]["target-only"][i]["output"]  # lossless at T=0
            assert written[name][i] == record
    assert any(r["output"] for r in written["random"])
    assert any("tiny" in line and "tau" in line for line in logs)
    for name in ("eval_results.json", "eval_report.md", "acceptance.png", "step_costs.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = (tmp_path / "eval_report.md").read_text()
    assert "| tiny | random |" in report
    # the default schedule is the cost-aware one: the report shows its measured curve and what the steps verified
    assert res["config"]["schedule"] == "auto"
    curve = res["config"]["step_cost_curve"]
    assert curve["tokens"][0] == 1 and len(curve["tokens"]) == len(curve["seconds"])
    assert "## Scheduling" in report and "| tiny | random | " in report.split("## Scheduling")[1]
    assert sum(figs["random"]["proposal_sizes"].values()) == figs["random"]["num_steps"]


def test_run_eval_second_turn_builds_on_each_methods_own_answer(target):
    """num_turns=2: a two-turn prompt runs turn 2 on [user1, own answer1, user2]; a one-turn prompt
    runs once; both turns' steps are pooled; samples hold one record per (prompt, turn)."""
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.report import markdown_report
    from deepspec.eval.run import answer_text, run_eval

    tok = _FakeChatTokenizer()
    width = target.config.hidden_size * len(LAYER_IDS)
    benches = {"mt": [BenchmarkPrompt(id="two", turns=("q1", "q2")),
                      BenchmarkPrompt(id="one", turns=("only question",))]}
    max_new = 5
    res = run_eval(target, tok, LAYER_IDS, {"random": RandomProposer(width, seed=2)}, benches,
                   max_new_tokens=max_new, sampling=SamplingParams(), seed=0, out_dir=None, progress=False,
                   warmup=False, log=lambda _: None, num_turns=2)
    figs = res["benchmarks"]["mt"]
    for name in ("target-only", "random", "hf-generate"):
        assert [(r["id"], r["turn"]) for r in res["samples"]["mt"][name]] == [("two", 1), ("two", 2), ("one", 1)]
        assert figs[name]["num_output_tokens"] == 3 * max_new
    assert figs["random"]["frac_identical_to_baseline"] == 1.0
    assert res["config"]["num_turns"] == 2
    # the speedup over first turns alone: the same prompts for every method
    firsts = {name: [r for r in res["samples"]["mt"][name] if r["turn"] == 1] for name in ("target-only", "random")}
    pooled = {name: sum(r["total_time_s"] for r in rs) / sum(r["num_new_tokens"] for r in rs)
              for name, rs in firsts.items()}
    assert figs["random"]["speedup_first_turn"] == pytest.approx(pooled["target-only"] / pooled["random"])
    assert figs["random"]["speedup_first_turn"] != pytest.approx(figs["random"]["speedup"], rel=1e-9)
    assert figs["random"]["speedup_first_turn_median"] == pytest.approx(statistics.median(
        (b["total_time_s"] / b["num_new_tokens"]) / (r["total_time_s"] / r["num_new_tokens"])
        for b, r in zip(firsts["target-only"], firsts["random"])))
    assert "speedup_first_turn" not in figs["target-only"]
    report = markdown_report(res)
    assert "| mt | random | " in report.split("First turns alone")[1]
    # every method rendered turn 2 on its own first answer (identical at T=0)
    first = hf_greedy(target, tok.apply_chat_template([{"role": "user", "content": "q1"}],
                                                      add_generation_prompt=True), max_new, VOCAB + 1)
    second_turns = [m for m in tok.rendered if len(m) == 3]
    assert len(second_turns) == 3  # target-only, random, hf-generate
    for msgs in second_turns:
        assert msgs == [{"role": "user", "content": "q1"},
                        {"role": "assistant", "content": tok.decode(first, skip_special_tokens=True)},
                        {"role": "user", "content": "q2"}]
    assert answer_text(tok, [5, 6, 7, VOCAB + 1], {VOCAB + 1}) == tok.decode([5, 6, 7])
    assert answer_text(tok, [0, 5], {VOCAB + 1}) == tok.decode([5])  # special tokens skipped
    with pytest.raises(ValueError, match="num_turns"):
        run_eval(target, tok, LAYER_IDS, {}, benches, max_new_tokens=3, sampling=SamplingParams(), seed=0,
                 out_dir=None, num_turns=0)


def test_run_eval_sampling_with_filters_runs_every_method(target):
    """T > 0 with top-k / top-p: every method (HF generate with the same filters) runs."""
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    width = target.config.hidden_size * len(LAYER_IDS)
    res = run_eval(target, _FakeChatTokenizer(), LAYER_IDS, {"random": RandomProposer(width, seed=2)},
                   {"tiny": [BenchmarkPrompt(id="p", turns=("hi",))]}, max_new_tokens=5,
                   sampling=SamplingParams(temperature=0.7, top_k=10, top_p=0.9), seed=0, out_dir=None,
                   progress=False, warmup=False, log=lambda _: None)
    assert all(m["num_output_tokens"] == 5 for m in res["benchmarks"]["tiny"].values())


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_low_temperature_sampling_matches_greedy(target, kind):
    """At T -> 0 the rejection-sampling path must reproduce greedy decoding: this checks that the
    verify rows (target p, draft q) are aligned with the draft tokens, at T > 0."""
    max_new = 16
    ref = hf_greedy(target, PROMPT, max_new + K + 1, eos_token_id_unused())
    width = target.config.hidden_size * len(LAYER_IDS)
    proposer = OracleProposer(width, PROMPT + ref) if kind == "oracle" else RandomProposer(width, seed=9)
    res = _engine(target, proposer, eos_token_id_unused()).generate(
        PROMPT, max_new_tokens=max_new, sampling=SamplingParams(temperature=1e-4), generator=torch.Generator().manual_seed(0)
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

        def prepare(self, num_positions):
            pass

        def reset(self):
            pass

        def extend_context(self, h, token_ids):
            pass

        def propose(self, anchor_token, anchor_pos, *, sampling, generator):
            ids = torch.multinomial(q_V, 2, replacement=True, generator=generator)
            return Proposal(draft_ids_N=ids, draft_probs_NV=q_V.expand(2, v).clone())

    engine = SpeculativeEngine(_BigramTarget(table), [0], SkewedProposer(), [v + 5], forward_fn=_bigram_forward)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, v)
    for _ in range(trials):
        out = engine.generate([1, 4], max_new_tokens=3, sampling=SamplingParams(temperature=1.0), generator=gen).output_ids
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
    config_mod = pytest.importorskip("deepspec.algorithms.dspark.config")
    dspark_mod = pytest.importorskip("deepspec.algorithms.dspark.model")
    from deepspec.algorithms.dspark.proposer import DSparkProposer

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
    res = engine.generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref
    assert all(s.num_proposed == K for s in res.steps)
    res = engine.generate(PROMPT, max_new_tokens=max_new, sampling=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0))
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

        def _propose(self, anchor_token, anchor_pos, sampling, generator):
            return Proposal(draft_ids_N=torch.randint(0, v, (K,), generator=self.gen))

    class RealOracle(CheckingProposer):
        def _propose(self, anchor_token, anchor_pos, sampling, generator):
            return Proposal(draft_ids_N=torch.tensor(seq[anchor_pos + 1 : anchor_pos + 1 + K]))

    for proposer in (RealRandom(width), RealOracle(width)):
        res = SpeculativeEngine(model, ids, proposer, [eos_token_id_unused()],
                                forward_fn=CacheCheckingForward()).generate(prompt, max_new_tokens=max_new)
        assert res.output_ids == ref[:max_new]
    assert all(s.num_accepted == K for s in res.steps)
