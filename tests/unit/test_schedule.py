"""The cost-aware step scheduler: the cost curve and its disk cache, the acceptance estimates, the
choice of what to verify, and the engine with the scheduler on (lossless greedy, only plain steps when
speculation cannot pay, the fixed K back when every token is free and every draft is right)."""

from __future__ import annotations

import pytest
import torch

from deepspec.algorithms.protocol import Proposal
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.schedule import (
    AcceptanceEstimator,
    StepCostCurve,
    StepScheduler,
    load_or_measure_step_costs,
    measure_step_costs,
    size_histogram,
)
from deepspec.decoding.verify import SamplingParams
from tests.unit.test_draft_tree import _dspark_draft
from tests.unit.test_engine import K, LAYER_IDS, PROMPT, OracleProposer, RandomProposer, hf_greedy, target  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = StepCostCurve((1, 64), (0.01, 0.01))  # every verify costs a one-token step
STEEP = StepCostCurve((1, 2, 64), (0.01, 0.02, 0.64))  # a verify over n tokens costs n one-token steps


def _chain(n: int, conf: list[float] | None = None) -> Proposal:
    return Proposal(draft_ids_N=torch.arange(2, 2 + n), confidence_N=None if conf is None else torch.tensor(conf))


def test_cost_curve_interpolates_extrapolates_and_refuses_bad_points():
    c = StepCostCurve((1, 3, 5), (1.0, 2.0, 2.5))
    assert c.seconds_for(1) == 1.0 and c.seconds_for(2) == 1.5 and c.seconds_for(4) == 2.25
    assert c.seconds_for(9) == pytest.approx(3.5)  # the last segment's slope
    assert c.relative(3) == 2.0
    assert StepCostCurve.from_dict(c.to_dict()) == c
    for tokens, seconds in [((2, 3), (1.0, 2.0)), ((1, 1), (1.0, 2.0)), ((1, 2), (1.0, 0.0)), ((), ())]:
        with pytest.raises(ValueError, match="StepCostCurve"):
            StepCostCurve(tokens, seconds)


def test_measure_step_costs_takes_the_fastest_round_interleaved_and_never_decreases():
    fed: list[int] = []
    now = [0.0]
    cost = {1: 1.0, 2: 3.0, 3: 2.0, 4: 4.0}  # 3 tokens measured faster than 2: the two are pooled
    def forward(n):
        fed.append(n)
        now[0] += cost[n] + (50.0 if n == 1 and len(fed) == 5 else 0.0)  # one slow round of 1 token (a busy machine)

    curve = measure_step_costs(forward, 4, repeats=2, clock=lambda: now[0])
    assert curve.tokens == (1, 2, 3, 4) and curve.seconds == (1.0, 2.5, 2.5, 4.0)
    assert fed == [1, 2, 3, 4] * 3  # one warm-up pass, then rounds over every size
    with pytest.raises(ValueError, match="max_tokens"):
        measure_step_costs(forward, 0)


def test_cost_curve_is_cached_by_key(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return StepCostCurve((1, 2), (0.5, 0.6))

    key = {"config": "abc", "threads": 2}
    first, measured = load_or_measure_step_costs(key, measure, cache_dir=tmp_path)
    again, measured_again = load_or_measure_step_costs(key, measure, cache_dir=tmp_path)
    assert (measured, measured_again, len(calls)) == (True, False, 1) and again == first
    load_or_measure_step_costs({**key, "threads": 1}, measure, cache_dir=tmp_path)
    assert len(calls) == 2  # another thread count is another curve
    for f in tmp_path.iterdir():
        f.write_text("{not json")
    load_or_measure_step_costs(key, measure, cache_dir=tmp_path)
    assert len(calls) == 3  # an unreadable file is measured again


def test_estimator_starts_at_the_score_and_learns_from_counts():
    est = AcceptanceEstimator()
    assert est.estimate(1, 0, 0.9) == pytest.approx(0.9)
    for _ in range(50):
        est.observe(1, 0, 0.9, accepted=False)  # an overconfident head
    assert est.estimate(1, 0, 0.9) < 0.1
    assert est.estimate(1, 0, None) < 0.1  # the depth's running mean learned it too
    est.start_request()
    assert est.estimate(1, 0, 0.3) == pytest.approx(0.3)  # other bins keep their prior
    assert est.estimate(1, 1) == pytest.approx(est.other_prior)


def test_estimates_are_kept_per_source():
    est = AcceptanceEstimator()
    for _ in range(30):
        est.observe(1, 0, None, accepted=True, source="lookup")
        est.observe(1, 0, None, accepted=False)  # the draft's
    assert est.estimate(1, source="lookup") > 0.9 and est.estimate(1) < 0.1
    assert est.estimate(1, source="corpus") == pytest.approx(est.first_prior)  # nothing seen from a corpus yet
    # a tree's lookup node beside a draft node is estimated as the lookup's chain, not as a second-ranked sibling
    tree = Proposal(draft_ids_N=torch.tensor([5, 6]), parents_N=(-1, -1), sources_N=("draft", "lookup"))
    sched = StepScheduler(StepCostCurve((1, 2, 3), (0.01, 0.0105, 0.011)))  # each node costs 1/20 of a step
    sched.estimator = est
    assert sched.select(tree, greedy=True).draft_ids_N.tolist() == [6]


def test_flat_costs_and_certain_drafts_verify_the_whole_proposal():
    sched = StepScheduler(FLAT)
    sched.estimator = AcceptanceEstimator(first_prior=1.0)
    assert sched.plan(K)
    p = _chain(K)
    assert sched.select(p, greedy=True) is p and sched.select(p, greedy=False) is p


def test_costs_that_never_pay_give_plain_steps():
    sched = StepScheduler(STEEP, probe_every=1000)
    sched.propose_s = 0.005  # half a step: proposing must pay for itself
    sched.estimator = AcceptanceEstimator(first_prior=0.5)
    assert not sched.plan(K)
    assert sched.select(_chain(K), greedy=True).num_proposed == 0
    assert sched.select(_chain(K, [0.9, 0.9, 0.9, 0.9]), greedy=False).num_proposed == 0


def test_chain_is_cut_where_the_confidence_drops():
    sched = StepScheduler(StepCostCurve((1, 64), (0.01, 0.01 * 1.5)))  # each token 1/126 of a step
    cut = sched.select(_chain(4, [0.95, 0.9, 0.001, 0.9]), greedy=False)
    assert cut.draft_ids_N.tolist() == [2, 3] and cut.confidence_N.tolist() == pytest.approx([0.95, 0.9])


def test_tree_keeps_the_likeliest_nodes_with_their_ancestors():
    # anchor -> a (node 0) -> b (node 2); anchor -> c (node 1, a second-ranked sibling)
    tree = Proposal(draft_ids_N=torch.tensor([5, 6, 7]), parents_N=(-1, -1, 0))
    sched = StepScheduler(StepCostCurve((1, 2, 64), (0.01, 0.0101, 0.0101 + 0.062)))
    sched.estimator = AcceptanceEstimator(first_prior=0.9, other_prior=0.001)
    kept = sched.select(tree, greedy=True)
    assert kept.draft_ids_N.tolist() == [5, 7] and kept.parents_N == (-1, 0)
    sched.depth_limit = 1  # at T > 0 a tree is cut only at the depth planned before it was drawn
    assert sched.select(tree, greedy=False).draft_ids_N.tolist() == [5, 6]


def test_an_alternative_is_worth_what_its_elder_sibling_leaves():
    """At T = 0 at most one child of a node matches the target: an alternative is accepted only where the first
    choice is rejected, so below a first choice the head is sure of it is worth little and is cut, and below an
    unsure one it is kept; its counts are taken only where the first choice was rejected."""
    sched = StepScheduler(StepCostCurve((1, 64), (0.01, 0.01 + 63 * 0.0005)))  # a node: 0.05 of a step
    sched.estimator = AcceptanceEstimator(other_prior=0.3)

    def kept(first_score: float) -> list[int]:
        tree = Proposal(draft_ids_N=torch.tensor([5, 6]), parents_N=(-1, -1),
                        confidence_N=torch.tensor([first_score, float("nan")]))
        return sched.select(tree, greedy=True).draft_ids_N.tolist()

    assert kept(0.2) == [5, 6]  # the alternative: 0.3 of the 0.8 left, 0.24 tokens
    assert kept(0.95) == [5]  # 0.3 of the 0.05 left: 0.015 tokens, under its 0.05 steps
    tree = Proposal(draft_ids_N=torch.tensor([5, 6]), parents_N=(-1, -1))
    before = sched.estimator.estimate(1, 1)
    sched.observe(tree, 1, [0], verify_s=0.01, propose_s=None, overhead_s=0.0, num_committed=2, step_s=0.01)
    assert sched.estimator.estimate(1, 1) == before  # the first choice was accepted: the alternative had no chance


def test_a_tree_s_alternatives_count_in_the_plan():
    """A level of a draft tree holds the accepted token more often than its first choice alone does: the plan
    counts the alternatives, so a tree is proposed where its first choices alone would not pay the call."""
    sched = StepScheduler(FLAT)
    sched.propose_s = 0.003  # a draft call: 0.3 of a step
    sched.estimator = AcceptanceEstimator(first_prior=0.2, other_prior=0.3)
    assert not sched.plan(1)  # a first choice: 0.2 tokens
    assert sched.plan(1, width=3)  # a level of three: 1 - 0.8 * 0.7 * 0.7 = 0.61 tokens


def test_subset_refuses_orphans_and_disorder():
    tree = Proposal(draft_ids_N=torch.tensor([5, 6, 7]), parents_N=(-1, -1, 0))
    with pytest.raises(ValueError, match="node 2 is kept without its parent 0"):
        tree.subset([1, 2])
    with pytest.raises(ValueError, match="increasing node indices"):
        tree.subset([1, 0])
    assert _chain(3).subset([0, 1]).draft_ids_N.tolist() == [2, 3]


def test_size_histogram():
    assert size_histogram([0, 3, 0, 1]) == {"0": 2, "1": 1, "3": 1}


def _greedy_engine(model, proposer, schedule):
    return SpeculativeEngine(model, LAYER_IDS, proposer, [1], schedule=schedule)


def test_engine_with_steep_costs_makes_plain_steps_and_backed_off_probes_and_stays_lossless(target):
    reference = hf_greedy(target, PROMPT, 30, 1)
    sched = StepScheduler(STEEP, probe_every=2, probe_budget=None)
    sched.estimator = AcceptanceEstimator(first_prior=0.05)
    res = _greedy_engine(target, RandomProposer(32), sched).generate(PROMPT, max_new_tokens=30)
    assert res.output_ids == reference
    # the first step calls the proposer (its call's cost is not known yet) and verifies none of it; then the
    # proposer is called only to probe, after 2, 4, 8.. plain steps while its probes accept nothing, and a
    # probe verifies exactly its first node (the first step, its proposal cut whole, counts as a plain step)
    assert res.steps[0].drafted and res.steps[0].num_drafted > 0 and res.steps[0].num_proposed == 0
    interval, streak = 2, 1
    for s in res.steps[1:]:
        if not s.drafted:
            assert s.num_proposed == 0
            streak += 1
            continue
        assert streak == interval and s.num_proposed == 1
        interval, streak = (2 if s.num_accepted else 2 * interval), 0
    assert sum(s.drafted for s in res.steps) <= 4


def _probing_scheduler(**kwargs) -> StepScheduler:
    """A scheduler on STEEP whose draft call (half a step) never pays: it proposes only to probe."""
    sched = StepScheduler(STEEP, **kwargs)
    sched.propose_s = 0.005
    sched.estimator = AcceptanceEstimator(first_prior=0.01)
    sched.reset()
    return sched


def _plain_steps_before_a_probe(sched: StepScheduler, accepted: int, step_s: float = 0.025) -> int:
    """Plan plain steps until a probe, verify it (``accepted`` of its node, the step taking ``step_s``);
    return the plain steps before it."""
    n = 0
    while not sched.plan(K):
        n += 1
    assert sched.probing
    probe = sched.select(_chain(K), greedy=True)
    assert probe.num_proposed == 1  # a probe verifies its first node even where it does not pay
    sched.observe(probe, accepted, None, verify_s=0.02, propose_s=0.005, overhead_s=0.0, num_committed=1 + accepted,
                  step_s=step_s)
    return n


def test_probe_interval_doubles_on_a_fruitless_probe_and_resets():
    sched = _probing_scheduler(probe_every=2, max_probe_every=8, probe_budget=None)
    probes = lambda: _plain_steps_before_a_probe(sched, 0)  # noqa: E731
    assert [probes() for _ in range(4)] == [2, 4, 8, 8]  # capped at max_probe_every
    assert _plain_steps_before_a_probe(sched, 1) == 8 and probes() == 2  # an accepted token resets
    probes()
    sched.reset()  # a new request starts at probe_every
    assert probes() == 2


def test_fruitless_probes_cost_at_most_the_probe_budget_of_the_plain_steps_between_them():
    # a plain step costs 0.01 s; a fruitless probe 0.025 s, 0.015 s more: at a 10 % budget 15 plain steps pay for it
    sched = _probing_scheduler(probe_every=2, max_probe_every=64, probe_budget=0.1)
    probes = lambda: _plain_steps_before_a_probe(sched, 0)  # noqa: E731
    assert [probes() for _ in range(5)] == [2, 15, 30, 60, 64]  # the budget's floor, then the doubling
    sched.reset()  # the next request starts where the budget puts its first probe
    assert probes() == 15
    assert _plain_steps_before_a_probe(sched, 1) == 30 and probes() == 2  # an accepted token resets to probe_every
    # a probe that costs about a plain step leaves the doubling alone
    cheap = _probing_scheduler(probe_every=2, max_probe_every=64, probe_budget=0.1)
    assert [_plain_steps_before_a_probe(cheap, 0, step_s=0.0101) for _ in range(4)] == [2, 4, 8, 16]


def test_a_probe_waits_for_the_plain_steps_that_pay_for_its_flush():
    """A draft call first flushes the context positions queued since the last one (a request's prompt): its
    seconds per position are learned apart from the call's drafting and the probe's cost, and a probe on a
    request whose flush is dear waits until the budget's share of the plain steps pays for it too."""
    sched = _probing_scheduler(probe_every=2, max_probe_every=64, probe_budget=0.1)
    n = 0
    while not sched.plan(K, pending=400 + n):  # the first request: the flush's cost not known yet
        n += 1
    assert n == 2 and sched.probing
    probe = sched.select(_chain(K), greedy=True)
    call_s = 0.005 + 402 * 1e-4  # the drafting, and 402 queued positions at 0.1 ms each
    sched.observe(probe, 0, None, verify_s=0.02, propose_s=call_s, overhead_s=0.0, num_committed=1,
                  step_s=call_s + 0.02)
    assert sched.flush_s_per_position == pytest.approx(1e-4)
    assert sched.propose_s == pytest.approx(0.005)  # the drafting's own seconds, the flush taken out
    assert sched.probe_cost_s == pytest.approx(0.015)  # the probe's verify and drafting over a plain step

    def plain_steps_before_a_probe(pending: int) -> int:
        sched.reset()
        n = 0
        while not sched.plan(K, pending=pending):
            n += 1
        sched.select(_chain(K), greedy=True)
        sched.observe(_chain(1), 1, None, verify_s=0.02, propose_s=0.005 + pending * 1e-4, overhead_s=0.0,
                      num_committed=2, step_s=0.025 + pending * 1e-4)
        return n

    assert plain_steps_before_a_probe(3) == 16  # (0.015 + 3 * 0.1 ms) / (10 % of 0.01 s)
    assert plain_steps_before_a_probe(400) == 55  # the 40 ms flush paid for as well
    assert plain_steps_before_a_probe(4000) == 64  # capped at max_probe_every
    # a step the plan expects to pay is not held back by the flush: it serves the request's later draft calls
    paying = StepScheduler(FLAT, flush_s_per_position=1e-4, propose_s=0.001)
    paying.reset()
    assert paying.plan(K, pending=4000) and not paying.probing


def test_a_request_s_own_counts_soon_outweigh_the_long_run():
    est = AcceptanceEstimator()
    for _ in range(100):
        est.observe(1, 0, None, accepted=True)  # a request where the draft was always right
    assert est.estimate(1) > 0.95
    est.start_request()
    for _ in range(6):
        est.observe(1, 0, None, accepted=False)  # the next request: prompts the draft does not know
    assert est.estimate(1) < 0.35
    assert est.estimate(2) < 0.35  # one factor per request: every first choice follows
    est.start_request()  # a third request starts from the long-run figure, which 6 rejections barely moved
    assert est.estimate(1) > 0.85


def test_a_request_starts_from_the_long_run_whatever_the_requests_before_it():
    """What past requests taught is in the cells: a request after several the draft did not know starts at
    factor 1, so a request the draft knows does not open with plain steps on their account."""
    est = AcceptanceEstimator()
    for _ in range(60):
        est.observe(1, 0, None, accepted=True)  # an in-domain request: 60 nodes
    est.start_request()
    for _ in range(4):
        est.observe(1, 0, None, accepted=False)  # four unknown requests, a probe or two each
        est.observe(1, 0, None, accepted=False)
        assert est.request_factor() < 0.8
        est.start_request()
        assert est.request_factor() == 1.0
    assert est.estimate(1) == pytest.approx(est._long_run(1, 0, None, "draft"))
    assert est.estimate(1) > 0.75


def test_a_request_scales_a_tree_s_alternatives_down_never_up():
    """A draft tree's alternative (a sibling ranked below the first choice) is accepted only where the first
    choice is rejected: a request on which the first choices do better leaves it less (through their rejection),
    so it is not raised with them; a request on which they do worse is one the draft is off on, and it falls
    with them."""
    est = AcceptanceEstimator()
    for i in range(200):  # the long run: first choices accepted half the time, an alternative below them 1 in 20
        est.observe(1, 0, None, accepted=i % 2 == 0)
        est.observe(1, 1, None, accepted=i % 20 == 0)
    long_run = est._long_run(1, 1, None, "draft")
    est.start_request()
    for _ in range(10):  # an easy request: every first choice accepted
        est.observe(1, 0, None, accepted=True)
    assert est.estimate(1) > 0.7 and est.estimate(1, 1) == pytest.approx(long_run)
    est.start_request()
    for _ in range(10):  # a hard one: none
        est.observe(1, 0, None, accepted=False)
    assert est.estimate(1) < 0.25 and est.estimate(1, 1) < long_run / 2


def test_a_request_easier_than_the_long_run_raises_its_estimates_below_one():
    est = AcceptanceEstimator()
    for _ in range(100):
        est.observe(1, 0, None, accepted=False)  # a long run where the draft was seldom right
    est.start_request()
    low = est.estimate(1)
    for _ in range(4):
        est.observe(1, 0, None, accepted=True)
    assert low < 0.05 and 0.5 < est.estimate(1) < 1.0


def test_the_bookkeeping_of_a_verifying_step_is_weighed():
    """A step that verifies draft nodes spends more besides its forward than a plain step (features handed to
    the proposer, KV entries moved); a node whose expected gain is below that is cut."""
    sched = StepScheduler(FLAT)  # the forward itself costs the same over any number of tokens
    sched.estimator = AcceptanceEstimator(first_prior=0.3)
    assert sched.select(_chain(1), greedy=True).num_proposed == 1
    plain, verified = Proposal.empty(), _chain(1)
    sched.observe(plain, 0, None, verify_s=0.01, propose_s=None, overhead_s=0.001, num_committed=1, step_s=0.011)
    for _ in range(30):  # each verifying step spends half a one-token step more
        sched.observe(verified, 0, None, verify_s=0.01, propose_s=0.0, overhead_s=0.006, num_committed=1, step_s=0.016)
    assert sched.verify_extra_s() == pytest.approx(0.005, rel=0.05)
    sched.estimator = AcceptanceEstimator(first_prior=0.3)
    assert sched.select(_chain(1), greedy=True).num_proposed == 0  # 0.3 tokens against half a step
    sched.propose_s = 0.001
    assert not sched.plan(1)  # nor does a proposal pay for its call


def test_one_slow_step_moves_the_price_of_a_step_for_a_few_steps_only():
    """Step timings are skewed (a kernel's first call at a new shape, other work on the host): one slow draft call
    and verify are outvoted by the next two, not averaged in and held through the plain steps that follow (which
    time neither), where they would keep refusing proposals that pay."""
    sched = StepScheduler(FLAT)
    chain = _chain(2)

    def step(propose_s: float, verify_s: float) -> None:
        sched.observe(chain, 1, None, verify_s=verify_s, propose_s=propose_s, overhead_s=0.0, num_committed=2,
                      step_s=propose_s + verify_s)

    step(0.05, 0.04)  # cold: the draft call takes five one-token steps, the verify four
    assert sched.propose_s == pytest.approx(0.05) and sched.verify_excess_s == pytest.approx(0.03)
    step(0.002, 0.01)
    step(0.002, 0.01)
    assert sched.propose_s == pytest.approx(0.002)
    assert sched.verify_excess_s < 0.002  # the scale took part of the slow verify: a tenth of a step at most
    with pytest.raises(ValueError, match="timing_window"):
        StepScheduler(FLAT, timing_window=0)


def test_a_draft_call_that_flushes_the_prompt_before_any_is_timed_teaches_no_drafting_cost():
    """A request's first draft call runs the prompt through the draft before drafting; before the scheduler has
    timed a call without a flush it cannot tell the two apart, so that call sets neither figure (it would price
    the draft at its prompt's flush), and the next call, which flushes a few positions, times the drafting."""
    sched = StepScheduler(FLAT)
    sched.estimator = AcceptanceEstimator(first_prior=0.9)

    def draft_step(pending: int, call_s: float) -> None:
        assert sched.plan(K, pending=pending)
        kept = sched.select(_chain(K), greedy=True)
        sched.observe(kept, K, None, verify_s=0.01, propose_s=call_s, overhead_s=0.0, num_committed=K + 1,
                      step_s=call_s + 0.01)

    draft_step(300, 0.002 + 300 * 1e-4)  # 2 ms drafting, 300 prompt positions at 0.1 ms
    assert sched.propose_s == 0.0 and sched.flush_s_per_position == 0.0
    draft_step(1, 0.002)
    assert sched.propose_s == pytest.approx(0.002)
    draft_step(200, 0.002 + 200 * 1e-4)  # the next request's prompt: the flush is told apart now
    assert sched.flush_s_per_position == pytest.approx(1e-4) and sched.propose_s == pytest.approx(0.002)


def test_a_verify_forward_slower_than_the_curve_says_is_weighed():
    """Plain steps keep the curve's scale; a forward that verifies draft nodes and takes longer than the
    curve says for its token count (a tree mask's attention path, kernels plain steps leave cold) adds that
    measured excess to the price of verifying any node, so a node worth less is cut."""
    sched = StepScheduler(FLAT)
    plain, verified = Proposal.empty(), _chain(1)
    for _ in range(30):
        sched.observe(plain, 0, None, verify_s=0.01, propose_s=None, overhead_s=0.0, num_committed=1, step_s=0.01)
        sched.observe(verified, 0, None, verify_s=0.015, propose_s=0.0, overhead_s=0.0, num_committed=1,
                      step_s=0.015)
    assert sched.verify_excess_s == pytest.approx(0.005, rel=0.25)
    assert sched.verify_extra_s() == pytest.approx(sched.verify_excess_s)
    sched.estimator = AcceptanceEstimator(first_prior=0.3)
    assert sched.select(_chain(1), greedy=True).num_proposed == 0  # 0.3 tokens against half a step
    sched.verify_excess_s = 0.0
    assert sched.select(_chain(1), greedy=True).num_proposed == 1


def test_a_cheap_proposer_cut_whole_is_still_probed():
    """A proposer that costs nothing to call is always called, and the scheduler decides from its proposal;
    where every proposal is cut whole, the calls count as plain steps and a probe verifies one node."""
    sched = StepScheduler(STEEP, probe_every=2)
    sched.estimator = AcceptanceEstimator(first_prior=0.01)
    sched.reset()
    kept = []
    for _ in range(6):
        assert sched.plan(K)  # propose_s is 0: a call costs nothing, so it is always made
        proposal = sched.select(_chain(K), greedy=True)
        kept.append(proposal.num_proposed)
        sched.observe(proposal, 0, None, verify_s=0.01, propose_s=0.0, overhead_s=0.0, num_committed=1, step_s=0.01)
    assert kept == [0, 0, 1, 0, 0, 0]  # a probe after 2 cut steps; fruitless, the next after 4


@pytest.mark.parametrize("confidence, kept", [(0.95, 1), (0.02, 0)])
def test_a_tree_s_scored_nodes_are_kept_or_cut_by_their_score(confidence, kept):
    """DSpark scores the first choice at each depth of its tree (``confidence_N``, NaN elsewhere); the
    scheduler estimates those nodes from the score."""
    sched = StepScheduler(StepCostCurve((1, 65), (0.01, 0.33)))  # each extra token fed costs half a one-token step
    sched.estimator = AcceptanceEstimator(first_prior=0.3, other_prior=0.01)  # unscored, 0.3 against its cost 0.5
    tree = Proposal(draft_ids_N=torch.tensor([5, 6, 7]), parents_N=(-1, -1, 0),
                    confidence_N=torch.tensor([confidence, float("nan"), 0.01]))
    assert sched.select(tree, greedy=True).num_proposed == kept


def test_a_proposal_cut_whole_by_its_scores_lowers_the_planned_acceptance():
    sched = StepScheduler(STEEP)
    before = sched.estimator.estimate(1)
    sched.propose_s = 0.0
    for _ in range(5):
        assert sched.plan(K)
        assert sched.select(_chain(K, [0.02] * K), greedy=True).num_proposed == 0
    assert sched.estimator.estimate(1) < before / 2  # plan() now expects what select() keeps cutting
    # the cuts are imputed to the planning mean alone: the request's factor and the scored cells saw no outcome
    assert sched.estimator.request_factor() == 1.0
    assert sched.estimator.estimate(1, 0, 0.02) == pytest.approx(0.02)


def test_a_lookup_match_is_verified_on_steps_the_draft_is_not_worth_calling(target):
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer
    from tests.unit.test_engine import VOCAB

    prompt = PROMPT * 3  # repeated text: prompt lookup matches from the first step
    reference = hf_greedy(target, prompt, 20, 1)
    sched = StepScheduler(FLAT, probe_every=1000)
    sched.propose_s = 1.0  # a draft call that never pays
    proposer = LookupFirstProposer(RandomProposer(32), vocab_size=VOCAB, ngram_min=1, max_positions=512)
    res = _greedy_engine(target, proposer, sched).generate(prompt, max_new_tokens=20)
    assert res.output_ids == reference
    assert not any(s.drafted for s in res.steps)  # the draft model never ran
    assert any(s.num_proposed > 0 for s in res.steps)  # the lookup's matches were verified all the same
    assert proposer.steps_from_draft == 0 and proposer.steps_from_lookup > 0


def test_engine_with_free_verifies_and_an_oracle_is_fixed_k(target):
    seq = PROMPT + hf_greedy(target, PROMPT, 40, 1)
    fixed = _greedy_engine(target, OracleProposer(32, seq), "fixed").generate(PROMPT, max_new_tokens=20)
    sched = StepScheduler(FLAT)
    sched.estimator = AcceptanceEstimator(first_prior=1.0)
    auto = _greedy_engine(target, OracleProposer(32, seq), sched).generate(PROMPT, max_new_tokens=20)
    assert auto.output_ids == fixed.output_ids
    assert [s.num_proposed for s in auto.steps] == [s.num_proposed for s in fixed.steps]
    assert all(s.drafted and s.schedule_s >= 0 for s in auto.steps)


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree3"])
def test_auto_schedule_is_lossless_greedy(target, tree_width, tmp_path, monkeypatch):
    from deepspec.algorithms.dspark.proposer import DSparkProposer

    monkeypatch.setenv("DEEPSPEC_CACHE_DIR", str(tmp_path))
    reference = hf_greedy(target, PROMPT, 24, 1)
    engine = _greedy_engine(target, DSparkProposer(_dspark_draft(target), tree_width=tree_width), "auto")
    res = engine.generate(PROMPT, max_new_tokens=24)
    assert res.output_ids == reference
    assert engine.scheduler is not None and engine.scheduler.curve.tokens[0] == 1
    assert list((tmp_path / "step-costs").glob("*.json"))  # the measured curve is cached
    again = engine.generate(PROMPT, max_new_tokens=24)
    assert again.output_ids == reference


def test_a_tree_cut_whole_is_a_plain_one_token_forward(target):
    """A draft tree the scheduler cuts to no node is verified as a target-only step is: one token, no tree mask
    (a mask sends attention down another kernel path, whose bits differ in bfloat16)."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.target.capture import target_forward

    calls = []

    def forward(model, input_ids_BT, layer_ids, **kwargs):
        calls.append((input_ids_BT.shape[1], kwargs.get("attention_mask_BT")))
        return target_forward(model, input_ids_BT, layer_ids, **kwargs)

    sched = StepScheduler(STEEP, probe_every=1000)
    sched.estimator = AcceptanceEstimator(first_prior=0.9)  # plan() proposes; the steep costs cut every tree whole
    engine = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(_dspark_draft(target), tree_width=2), [1],
                               schedule=sched, forward_fn=forward)
    res = engine.generate(PROMPT, max_new_tokens=8)
    assert res.output_ids == hf_greedy(target, PROMPT, 8, 1)
    assert all(s.num_proposed == 0 for s in res.steps) and any(s.num_drafted > 0 for s in res.steps)
    assert [mask for n, mask in calls[1:]] == [None] * len(res.steps) and all(n == 1 for n, _ in calls[1:])


def test_bad_schedule_is_refused(target):
    with pytest.raises(ValueError, match="schedule: expected 'auto'"):
        _greedy_engine(target, RandomProposer(32), "sometimes")


def test_schedule_stats_count_plain_and_undrafted_steps():
    from deepspec.decoding.engine import StepRecord
    from deepspec.eval.metrics import schedule_stats

    steps = [StepRecord(num_proposed=0, num_accepted=0, num_committed=1, time_s=1.0, drafted=False),
             StepRecord(num_proposed=0, num_accepted=0, num_committed=1, time_s=1.0, schedule_s=0.002),
             StepRecord(num_proposed=2, num_accepted=1, num_committed=2, time_s=1.0, num_draft_nodes=5,
                        schedule_s=0.004)]
    got = schedule_stats(steps)
    assert got["proposal_sizes"] == {"0": 2, "5": 1}
    assert got["frac_plain_steps"] == pytest.approx(2 / 3) and got["frac_steps_not_drafted"] == pytest.approx(1 / 3)
    assert got["schedule_ms_per_step"] == pytest.approx(2.0)


def test_a_serial_draft_is_priced_per_drafted_token():
    """A serial drafter's call (one draft forward per token) is priced per token it drafts: the planned depth
    is the one worth its drafting as well as its verify, and the price is learned per drafted token."""
    accept = AcceptanceEstimator(first_prior=0.9)
    whole, serial = StepScheduler(FLAT, estimator=accept), StepScheduler(FLAT, estimator=accept, serial_draft=True)
    for sched in (whole, serial):
        sched.propose_s = 0.004  # 0.4 one-token steps per call (serial: per drafted token)
        assert sched.plan(K)
    assert whole.depth_limit == K  # the call costs the same however deep: every slot whose verify pays
    assert serial.depth_limit == 3  # path probabilities 0.9, 0.73, 0.53, 0.35: the 4th is not worth 0.4 tokens
    serial.propose_s = 0.0
    serial.observe(_chain(4), 4, None, verify_s=0.01, propose_s=0.008, overhead_s=0.0, num_committed=5, step_s=0.02,
                   num_drafted=4)
    assert serial.propose_s == pytest.approx(0.002)
    serial.propose_s = 0.05  # five steps a token: nothing is worth drafting
    assert not serial.plan(K)


def test_the_planned_means_follow_every_observation_and_request():
    """depth_means (what plan() reads every step) are the estimates of now: after a node is counted and
    after a request starts, not the ones read before."""
    est = AcceptanceEstimator()
    now = lambda: tuple(est.estimate(d) for d in (1, 2, 3))  # noqa: E731
    first = est.depth_means(3)
    assert first == now()
    est.observe(1, 0, None, False)
    after_miss = est.depth_means(3)
    assert after_miss == now() and after_miss[0] < first[0]
    est.start_request()  # the request's factor is forgotten: the next request starts at 1
    assert est.depth_means(3) == now() != after_miss
    assert est.depth_means(2) == now()[:2]


def test_forgetting_acceptance_starts_a_new_workload_and_keeps_the_host_s_timings():
    """forget_acceptance clears what the traffic taught (the cells, the request's factor, the running rate) and
    keeps what the host taught (the curve's scale, the step timings); the next step sets the rate afresh."""
    sched = StepScheduler(FLAT, estimator=AcceptanceEstimator(first_prior=0.3, decay=0.9))
    for _ in range(20):  # whole proposals, all accepted
        sched.observe(_chain(K), K, None, verify_s=0.03, propose_s=0.004, overhead_s=0.001, num_committed=K + 1,
                      step_s=0.04)
    assert sched.estimator.estimate(1) > 0.8 and sched.rate > 0
    scale, propose_s, overhead_s = sched.scale, sched.propose_s, sched.verify_overhead_s
    sched.forget_acceptance()
    fresh = AcceptanceEstimator(first_prior=0.3, decay=0.9)
    assert sched.estimator == fresh and sched.estimator.decay == 0.9  # its settings kept, its counts gone
    assert [sched.estimator.estimate(d) for d in (1, 2, 3)] == [fresh.estimate(d) for d in (1, 2, 3)]
    assert sched.estimator.depth_means(3) == fresh.depth_means(3)
    assert sched.rate == 0.0 and sched.plain_streak == 0
    assert (sched.scale, sched.propose_s, sched.verify_overhead_s) == (scale, propose_s, overhead_s)
    sched.observe(_chain(K), 0, None, verify_s=0.03, propose_s=0.004, overhead_s=0.001, num_committed=1, step_s=0.05)
    assert sched.rate == pytest.approx(1 / 0.05)  # the first step after sets the rate, not a tenth of it


def test_dspark_counts_the_context_positions_its_next_call_flushes(target):  # noqa: F811
    """What the engine hands plan() as ``pending``: the positions queued since the last draft call."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.target.capture import target_forward

    proposer = DSparkProposer(_dspark_draft(target))
    feats = target_forward(target, torch.tensor([PROMPT]), LAYER_IDS).target_hidden_BTF[0]
    proposer.extend_context(feats, PROMPT)
    proposer.extend_context(feats[:1], [PROMPT[0]])
    proposer.extend_context(feats[:0], [])
    assert proposer.num_pending_features == len(PROMPT) + 1
    proposer.propose(9, len(PROMPT) + 1, sampling=SamplingParams(), generator=None)
    assert proposer.num_pending_features == 0
    proposer.extend_context(feats[:2], PROMPT[:2])
    assert proposer.num_pending_features == 2
    proposer.reset()
    assert proposer.num_pending_features == 0
