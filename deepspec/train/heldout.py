"""Held-out greedy tau during training: the learning curve, without a target forward per step.

Legend: P prompt length, N reference output length, T positions, F target feature width.

At temperature 0 speculative decoding is lossless: its output is the target's own greedy output,
whatever the draft proposes. So the acceptance of a draft on a prompt can be computed by *replaying*
the engine's loop (:class:`deepspec.decoding.engine.SpeculativeEngine`) against a reference made once:
the target's greedy continuation of the prompt and the target features of every position. Each
replayed step proposes from exactly the context the engine would hold (the features of positions
``< anchor``), accepts the longest prefix of drafts equal to the reference, commits accepted + 1
tokens and appends the features of the verified positions, as the engine does; an accepted EOS
ends the step (no bonus token: the step commits the accepted drafts alone, and tau counts those) and
the generation, and so does ``max_new_tokens``. The only difference from the engine is where
the features come from (one forward over the whole reference instead of the verify forwards), which
is equal up to floating-point rounding (exact in the tests, in float32).

So the draft can be evaluated every few hundred training steps on a fixed prompt set at the cost of
the draft's own forwards alone (a few seconds on a CPU), and the reference (the target's greedy
outputs and features) is made once per run and kept in the run folder. :class:`HeldoutCurve` is the
trainer's side: the reference of a run (made with :func:`capture_target`, on the prompts of
:func:`heldout_prompt_ids`) and its evaluation of the current weights.

A drafter with a confidence head (DSpark) reports a confidence per proposed slot; the replayed steps keep
them, so each evaluation also yields the eval's calibration pairs (:func:`deepspec.eval.metrics.calibration_pairs`:
slot k's raw confidence against whether it was accepted, slots up to the first rejection), their AUROC
and ECE, and a confidence calibration fitted on them (:func:`deepspec.models.calibration.fit_calibration`);
the trainer saves the last one with the draft (docs/design/decoding.md, "Confidence calibration").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from deepspec.algorithms.protocol import NullProposer, Proposer
from deepspec.data.chat import render_prompt, target_stop_token_ids
from deepspec.decoding.engine import GREEDY, SpeculativeEngine, StepRecord
from deepspec.device import cast_for_decoding
from deepspec.eval.benchmarks import load_benchmark
from deepspec.eval.metrics import DEFAULT_NUM_BINS, auroc, calibration_pairs, expected_calibration_error
from deepspec.models.calibration import ConfidenceCalibration, fit_calibration
from deepspec.target.capture import target_forward
from deepspec.target.load import target_fingerprint
from deepspec.train.config import TrainConfig
from deepspec.train.distributed import Dist, state_dict_options
from deepspec.utils import atomic_path

REFERENCE_NAME = "heldout_reference.pt"


@dataclass
class HeldoutReference:
    """One prompt's reference: ``prompt_ids`` (P), the target's greedy ``output_ids`` (N, ending
    with an EOS or cut at the reference length) and ``target_hidden_TF`` float32 ``[P + N, F]``
    (features of every position, captured with :func:`deepspec.target.capture.target_forward`).
    ``benchmark`` names the prompt set it came from."""

    benchmark: str
    prompt_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    target_hidden_TF: Tensor


@dataclass
class ReplayResult:
    """Greedy acceptance of one prompt: ``accepted`` drafts and ``committed`` tokens per verify step (accepted + 1,
    or accepted at an accepted EOS: no bonus token follows it; the engine's ``num_committed`` before the
    ``max_new_tokens`` cut), output tokens produced, and per step the engine's record
    (:class:`~deepspec.decoding.engine.StepRecord`, times 0): proposed, accepted, committed and the proposal's raw
    confidences (the head's, before any calibration; None without a head)."""

    accepted: list[int]
    num_output_tokens: int
    committed: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean committed tokens per verify step (:mod:`deepspec.eval.metrics`' tau); NaN without a step."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")


@torch.no_grad()
def make_reference(target_model: Any, prompts: Sequence[tuple[str, str, list[int]]], target_layer_ids: list[int],
                   eos_token_ids: Collection[int], *, max_new_tokens: int, block_size: int) -> list[HeldoutReference]:
    """The target's greedy continuation of each prompt and its features (module docstring).

    Args:
        target_model: the target (eval mode).
        prompts: ``(benchmark, prompt id, prompt ids)`` per prompt.
        target_layer_ids: the draft's feature layers.
        eos_token_ids: tokens that end generation (as the engine's).
        max_new_tokens: the output tokens a replay produces; the reference holds ``block_size`` more,
            so the last step's proposals can be checked against what the target would say.
        block_size: the most tokens a proposal holds.

    Returns one :class:`HeldoutReference` per prompt (features float32 on the CPU).
    """
    engine = SpeculativeEngine(target_model, target_layer_ids, NullProposer(), eos_token_ids)
    device = next(target_model.parameters()).device
    refs = []
    for bench, pid, ids in prompts:
        out = engine.generate(ids, max_new_tokens=max_new_tokens + block_size).output_ids
        full_1T = torch.tensor([list(ids) + out], dtype=torch.long, device=device)
        hidden = target_forward(target_model, full_1T, list(target_layer_ids)).target_hidden_BTF[0]
        refs.append(HeldoutReference(bench, pid, list(ids), list(out), hidden.float().cpu()))
    return refs


@torch.no_grad()
def replay_greedy(proposer: Proposer, ref: HeldoutReference, *, max_new_tokens: int,
                  eos_token_ids: Collection[int], device: torch.device | str | None = None) -> ReplayResult:
    """Replay the engine's greedy loop with ``proposer`` against ``ref`` (module docstring); the
    features go to ``device`` (the draft's; None: where they are).

    Raises ValueError when ``max_new_tokens`` exceeds what the reference can check (its output is
    shorter than ``max_new_tokens + K`` without ending in an EOS).
    """
    eos = frozenset(int(t) for t in eos_token_ids)
    out, P = ref.output_ids, len(ref.prompt_ids)
    if not out:
        return ReplayResult([], 0)
    K = int(proposer.max_proposal_len)
    if out[-1] not in eos and len(out) < max_new_tokens + K:
        raise ValueError(f"replay_greedy: the reference of {ref.prompt_id!r} holds {len(out)} output tokens; "
                         f"max_new_tokens={max_new_tokens} with proposals of {K} needs {max_new_tokens + K}.")
    full = list(ref.prompt_ids) + list(out)
    feats_TF = ref.target_hidden_TF if device is None else ref.target_hidden_TF.to(device)
    proposer.reset()
    proposer.extend_context(feats_TF[:P], list(ref.prompt_ids))
    anchor_pos, produced, accepted_steps, committed_steps, records = P, 1, [], [], []
    done = out[0] in eos
    while not done and produced < max_new_tokens:
        proposal = proposer.propose(full[anchor_pos], anchor_pos, sampling=GREEDY, generator=None)
        drafts = proposal.draft_ids_N.tolist()
        accepted, hit_eos = 0, False
        for d in drafts:
            nxt = anchor_pos + 1 + accepted
            if nxt >= len(full) or d != full[nxt]:
                break
            accepted += 1
            if d in eos:
                hit_eos = True  # an accepted EOS ends the step there (no bonus token) and the generation
                break
        num_verified = accepted + 1
        # committed: the accepted drafts, then the target's own token (unless an EOS was accepted)
        committed = full[anchor_pos + 1: anchor_pos + accepted + 1 + (0 if hit_eos else 1)]
        if not hit_eos and anchor_pos + num_verified >= len(full):
            raise AssertionError("replay_greedy: the reference ended before the step's bonus token")
        accepted_steps.append(accepted)
        committed_steps.append(len(committed))
        conf = proposal.raw_confidence_N if proposal.raw_confidence_N is not None else proposal.confidence_N
        records.append(StepRecord(num_proposed=len(drafts), num_accepted=accepted, num_committed=len(committed),
                                  time_s=0.0, confidence=None if conf is None else tuple(conf.tolist())))
        proposer.extend_context(feats_TF[anchor_pos: anchor_pos + num_verified],
                                full[anchor_pos: anchor_pos + num_verified])
        anchor_pos += num_verified
        produced += len(committed)
        done = any(t in eos for t in committed)
    return ReplayResult(accepted_steps, min(produced, max_new_tokens), committed_steps, records)


def heldout_tau(proposer: Proposer, refs: Sequence[HeldoutReference], *, max_new_tokens: int,
                eos_token_ids: Collection[int], device: torch.device | str | None = None,
                steps_out: list[StepRecord] | None = None) -> dict[str, float]:
    """Greedy tau (mean committed tokens over verify steps, pooled: accepted + 1, or accepted at an accepted EOS,
    as ``deepspec eval`` counts) over all references and per benchmark:
    ``{"heldout_tau": .., "heldout_tau_<benchmark>": ..}`` (NaN where no step was taken). ``steps_out``: a
    list the replayed steps' records are appended to (their raw confidences feed the calibration fit)."""
    per_bench: dict[str, list[int]] = {}
    for ref in refs:
        res = replay_greedy(proposer, ref, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, device=device)
        per_bench.setdefault(ref.benchmark, []).extend(res.committed)
        if steps_out is not None:
            steps_out.extend(res.steps)

    def tau(steps: list[int]) -> float:
        return sum(steps) / len(steps) if steps else float("nan")

    result = {"heldout_tau": tau([a for steps in per_bench.values() for a in steps])}
    result.update({f"heldout_tau_{b}": tau(steps) for b, steps in per_bench.items()})
    return result


def heldout_calibration(steps: Sequence[StepRecord], *, source: str = "heldout replay",
                        num_bins: int = DEFAULT_NUM_BINS) -> tuple[dict[str, float], ConfidenceCalibration | None]:
    """Fit the confidence calibration on replayed ``steps`` (their raw confidences) and measure it on them.

    Returns ``(figures, calibration)``: figures ``heldout_conf_pairs``, ``heldout_conf_auroc``,
    ``heldout_conf_ece`` (raw), ``heldout_conf_ece_calibrated``, ``heldout_conf_auroc_calibrated`` (the
    per-depth maps keep each depth's ranking, not the pooled one) and the mean confidence and accept rate
    (NaN where undefined); calibration None and figures ``{}`` when no step carries confidences. The fitted
    calibration's ``info`` records them. These are in-sample figures (fitted and measured on the same
    steps); the eval re-checks the saved calibration on its own prompts.
    """
    pairs = calibration_pairs([s for s in steps if s.confidence is not None])
    if not pairs:
        return {}, None
    cal = fit_calibration(pairs)
    conf, labels = [c for _, c, _ in pairs], [y for _, _, y in pairs]
    calibrated = [cal.apply(c, k) for k, c, _ in pairs]

    def num(x: float | None) -> float:
        return float("nan") if x is None else float(x)

    figures = {"heldout_conf_pairs": float(len(pairs)),
               "heldout_conf_accept_rate": sum(labels) / len(labels),
               "heldout_conf_mean": sum(conf) / len(conf),
               "heldout_conf_mean_calibrated": sum(calibrated) / len(calibrated),
               "heldout_conf_auroc": num(auroc(conf, labels)),
               "heldout_conf_auroc_calibrated": num(auroc(calibrated, labels)),
               "heldout_conf_ece": num(expected_calibration_error(conf, labels, num_bins)),
               "heldout_conf_ece_calibrated": num(expected_calibration_error(calibrated, labels, num_bins))}
    info = {"source": source, "num_pairs": len(pairs), "num_steps": sum(1 for s in steps if s.confidence is not None),
            **{k[len("heldout_conf_"):]: v for k, v in figures.items() if k != "heldout_conf_pairs"}}
    return figures, ConfidenceCalibration(cal.per_depth, cal.pooled, info)


def reference_key(prompts: Sequence[tuple[str, str, list[int]]], *, target_fingerprint: str,
                  target_layer_ids: Sequence[int], max_new_tokens: int, block_size: int,
                  eos_token_ids: Collection[int]) -> str:
    """A hash of everything a reference depends on (a stored reference is reused only if it matches)."""
    blob = json.dumps({"prompts": [list(p[:2]) + [list(p[2])] for p in prompts], "target": target_fingerprint,
                       "layers": list(target_layer_ids), "max_new_tokens": max_new_tokens, "block_size": block_size,
                       "eos": sorted(int(t) for t in eos_token_ids)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_or_make_reference(path: Path, key: str, make) -> list[HeldoutReference]:
    """The references stored at ``path`` when their key matches, else ``make()`` (stored atomically)."""
    if path.is_file():
        stored = torch.load(path, weights_only=False)
        if isinstance(stored, Mapping) and stored.get("key") == key:
            return [HeldoutReference(**r) for r in stored["references"]]
    refs = make()
    with atomic_path(path) as tmp:
        torch.save({"key": key, "references": [r.__dict__ for r in refs]}, tmp)
    return refs


def capture_target(target_model: torch.nn.Module, data, device: torch.device | None = None) -> torch.nn.Module:
    """The target as it ran when the training features were captured, on ``device`` (None: where it is):
    cast to a cache's capture dtype (``deepspec cache --dtype bfloat16``), else in its own dtype (float32
    caches, online mode); ``target_model`` itself when nothing changes, else a copy. The learning curve's
    reference is made with it, so the held-out features and greedy outputs come from the same target
    forward as the features the draft trains on, on the training device (a GPU, not the host)."""
    capture_dtype = ((getattr(data, "manifest", None) or {}).get("capture") or {}).get("dtype")
    dtype = getattr(torch, capture_dtype) if capture_dtype else next(target_model.parameters()).dtype
    return cast_for_decoding(target_model, dtype, device)


class HeldoutCurve:
    """The learning curve's held-out set: the reference (target greedy outputs + features, made once
    on rank 0 and kept in ``<output_dir>/heldout_reference.pt``) and its evaluation."""

    def __init__(self, cfg: TrainConfig, ctx: Dist, algorithm, target_model, tokenizer, target_layer_ids,
                 prompts: list[tuple[str, str, list[int]]] | None) -> None:
        self.cfg, self.ctx, self.algorithm = cfg, ctx, algorithm
        self.max_positions = int(target_model.config.max_position_embeddings)
        self.eos = target_stop_token_ids(target_model, tokenizer)  # the engine's stop rule
        self.refs = []
        if not ctx.is_main:
            return
        if prompts is None:
            prompts = heldout_prompt_ids(cfg.heldout_benchmarks, cfg.heldout_num_prompts, tokenizer)
        key = reference_key(prompts, target_fingerprint=target_fingerprint(target_model),
                            target_layer_ids=target_layer_ids, max_new_tokens=cfg.heldout_max_new_tokens,
                            block_size=algorithm.training_shape(cfg.options).proposal_len, eos_token_ids=self.eos)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)

        def make():
            print(f"train: learning curve: the target answers {len(prompts)} held-out prompts once (up to "
                  f"{cfg.heldout_max_new_tokens} tokens each; --heldout-every 0 turns the curve off)", flush=True)
            return make_reference(target_model, prompts, target_layer_ids, self.eos,
                                  max_new_tokens=cfg.heldout_max_new_tokens,
                                  block_size=algorithm.training_shape(cfg.options).proposal_len)

        self.refs = load_or_make_reference(Path(cfg.output_dir) / REFERENCE_NAME, key, make)
        self.calibration: ConfidenceCalibration | None = None  # the last evaluation's fit (rank 0)

    def evaluate(self, model: torch.nn.Module, template: torch.nn.Module | None) -> dict[str, float]:
        """Greedy held-out tau of the current weights (rank 0; other ranks only help gather: ``{}``); for a
        drafter with confidences also the calibration figures of :func:`heldout_calibration`, whose fit is
        kept in :attr:`calibration` (the trainer saves the last one with the draft)."""
        draft = model
        if self.ctx.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(model, options=state_dict_options(cpu_offload=True))
            if not self.ctx.is_main:
                return {}
            template.load_state_dict(state)
            draft = template
        proposer = self.algorithm.proposer(draft, max_positions=self.max_positions)
        device = next(draft.parameters()).device
        steps: list[StepRecord] = []
        result = heldout_tau(proposer, self.refs, max_new_tokens=self.cfg.heldout_max_new_tokens,
                             eos_token_ids=self.eos, device=device, steps_out=steps)
        figures, cal = heldout_calibration(
            steps, source=f"heldout replay: {len(self.refs)} prompts of {', '.join(self.cfg.heldout_benchmarks)}, "
                          f"up to {self.cfg.heldout_max_new_tokens} tokens each")
        if cal is not None:
            self.calibration = cal
        return {**result, **figures}


def heldout_prompt_ids(benchmarks: list[str], num_prompts: int, tokenizer) -> list[tuple[str, str, list[int]]]:
    """``(benchmark, prompt id, prompt ids)`` of the first turn of ``num_prompts`` prompts per
    benchmark: the same seeded sample ``deepspec eval`` takes (its default seed), rendered with the
    one prompt rule (:func:`deepspec.data.chat.render_prompt`)."""
    return [(name, p.id, render_prompt(tokenizer, p.messages))
            for name in benchmarks for p in load_benchmark(name, max_samples=num_prompts)]
