"""What exact rows cost a verify forward, and what they change: off and on side by side, per dtype.

One target forward over ``n`` new tokens at ``--context`` tokens of KV cache (the engine's call:
:func:`deepspec.target.capture.target_forward` with logits, then the KV cache cropped back), for ``n`` in
``--num-tokens``, with the stock kernels (``off``) and under
:class:`deepspec.target.exact_rows.ExactRows` (``on``, the engine's ``exact=True``). Timed interleaved
(every round runs each (n, path) once, in one process), ``--rounds`` rounds after two warm-up rounds; the
median is printed. ``on / off`` is the exact verify's cost over a plain one; ``n = 1`` is the one-token
step, which exact rows leave alone. ``--breakdown`` adds exact rows for attention only and for the linear
layers only (times and differences), to show what each op costs and fixes.

Then, per ``n`` and path, the logits of the ``n``-token forward are compared with those of ``n`` one-token
forwards over the same tokens (``--prompts`` random prompts of ``--context`` tokens): the fraction of logits
that differ, the largest difference, and the fraction of rows whose argmax differs. ``on`` should show 0.

``--lossless N``: greedy decoding of ``N`` tokens for a few chat prompts, target-only, then speculative with
a scripted draft that proposes the target-only output itself (K = 7: every draft is the target's own
choice, near-ties included), with exact rows off and on: how many outputs are identical to target-only and
how many drafts were accepted. Off, a bf16 verify's near-ties reject drafts and outputs diverge; on, none.

Writes ``exact_verify.json`` under ``--output-dir``.

    python bench/exact_verify.py                               # embedded SmolLM2-135M, bfloat16 and float32
    python bench/exact_verify.py --dtypes bfloat16 --num-tokens 1,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.device import (
    check_dtype_name,
    device_model_name,
    dtype_name,
    resolve_dtype,
)
from deepspec.target.capture import target_forward
from deepspec.target.exact_rows import ExactRows
from deepspec.utils import atomic_write_json

PATHS = ("off", "on")
BREAKDOWN = ("attention", "linear")  # --breakdown: exact rows for one op only


def _forward(model, ids: list[int], start: int, cache) -> torch.Tensor:
    """Logits ``[n, V]`` of the forward over ``ids`` after ``start`` cached positions (extends ``cache``)."""
    return target_forward(model, torch.tensor([ids]), [], position_ids_BT=torch.arange(start, start + len(ids))[None],
                          past_key_values=cache, use_cache=True, compute_logits=True).logits_BTV[0]


def _context(exact: dict[str, ExactRows], path: str, n: int):
    return exact[path](n) if path != "off" and n > 1 else contextlib.nullcontext()


@torch.inference_mode()
def measure(model, exact: dict[str, ExactRows], *, context: int, num_tokens: list[int], rounds: int,
            seed: int) -> dict[str, dict[int, float]]:
    """Median seconds of a forward over ``n`` new tokens after ``context`` cached ones, per path and n
    (``off``, and each path of ``exact``: name -> its ExactRows)."""
    paths = ("off", *exact)
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    cache = DynamicCache()
    _forward(model, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0, cache)
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in num_tokens} for p in paths}
    for r in range(rounds + 2):
        for n in num_tokens:
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            for path in paths:
                t0 = time.perf_counter()
                with _context(exact, path, n):
                    _forward(model, ids, context, cache)
                if r >= 2:
                    times[path][n].append(time.perf_counter() - t0)
                cache.crop(-n)
    return {p: {n: statistics.median(v) for n, v in by_n.items()} for p, by_n in times.items()}


@torch.inference_mode()
def differences(model, exact: dict[str, ExactRows], *, context: int, num_tokens: list[int], prompts: int,
                seed: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per path and n: ``logits`` (fraction of the n-token forward's logits that differ from n one-token
    forwards'), ``max`` (largest absolute difference) and ``argmax`` (fraction of rows whose argmax differs)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed + 1)
    vocab = int(model.config.vocab_size)
    n_max = max(num_tokens)
    paths = ("off", *exact)
    stats = {p: {n: {"logits": [], "max": [], "argmax": []} for n in num_tokens} for p in paths}
    for _ in range(prompts):
        ids = torch.randint(0, vocab, (context + n_max,), generator=gen).tolist()
        cache = DynamicCache()
        _forward(model, ids[:context], 0, cache)
        one_cache = copy.deepcopy(cache)
        one_NV = torch.cat([_forward(model, [t], context + i, one_cache) for i, t in enumerate(ids[context:])]).float()
        for n in num_tokens:
            for path in paths:
                with _context(exact, path, n):
                    many_NV = _forward(model, ids[context:context + n], context, copy.deepcopy(cache)).float()
                diff = (many_NV - one_NV[:n]).abs()
                stats[path][n]["logits"].append(float((diff > 0).float().mean()))
                stats[path][n]["max"].append(float(diff.max()))
                stats[path][n]["argmax"].append(float((many_NV.argmax(-1) != one_NV[:n].argmax(-1)).float().mean()))
    return {p: {n: {"logits": statistics.mean(s["logits"]), "max": max(s["max"]),
                    "argmax": statistics.mean(s["argmax"])} for n, s in by_n.items()} for p, by_n in stats.items()}


LOSSLESS_PROMPTS = ("What is the capital of France? Answer in one sentence.",
                    "Write a Python function that returns the n-th Fibonacci number.",
                    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                     "How many clips did Natalia sell altogether in April and May?"))


class ScriptedProposer:
    """Proposes the next ``max_proposal_len`` tokens of a fixed sequence (prompt + target-only output)."""

    needs_features = False
    max_proposal_len = 7

    def __init__(self, sequence: list[int], vocab_size: int) -> None:
        self.sequence, self.vocab_size = sequence, vocab_size

    def reset(self) -> None:
        pass

    def extend_context(self, target_hidden_TF, token_ids_T) -> None:
        pass

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        from deepspec.algorithms.protocol import Proposal

        ids = torch.tensor(self.sequence[anchor_pos + 1:anchor_pos + 1 + self.max_proposal_len], dtype=torch.long)
        return Proposal(draft_ids_N=ids, draft_probs_NV=torch.nn.functional.one_hot(ids, self.vocab_size).float())


def lossless(model, tokenizer, *, max_new_tokens: int) -> dict[str, dict[str, int]]:
    """Per path: ``identical`` outputs (of ``len(LOSSLESS_PROMPTS)``), ``accepted`` / ``proposed`` drafts, with a
    scripted draft that proposes the target-only output (see the module docstring)."""
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.eval.run import eos_token_ids_of

    eos = eos_token_ids_of(model, tokenizer)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    out = {p: {"identical": 0, "accepted": 0, "proposed": 0} for p in PATHS}
    for question in LOSSLESS_PROMPTS:
        prompt = render_prompt(tokenizer, [{"role": "user", "content": question}])
        ref = SpeculativeEngine(model, [], NullProposer(), eos).generate(prompt, max_new_tokens=max_new_tokens)
        for path in PATHS:
            engine = SpeculativeEngine(model, [], ScriptedProposer(prompt + ref.output_ids, vocab), eos,
                                       exact=path == "on")
            res = engine.generate(prompt, max_new_tokens=max_new_tokens)
            out[path]["identical"] += res.output_ids == ref.output_ids
            out[path]["accepted"] += sum(s.num_accepted for s in res.steps)
            out[path]["proposed"] += sum(s.num_proposed for s in res.steps)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: float32 | bfloat16 (CPU)")
    p.add_argument("--context", type=int, default=32, help="tokens already in the KV cache")
    p.add_argument("--num-tokens", default=",".join(str(n) for n in range(1, 17)),
                   help="comma-separated new-token counts (1: the one-token step)")
    p.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds")
    p.add_argument("--prompts", type=int, default=3, help="random prompts for the logit comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--lossless", type=int, default=0, metavar="N",
                   help="also decode N tokens greedily per chat prompt with a draft that proposes the target-only "
                        "output, exact rows off and on (0: skip)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time exact rows for attention only and for linear layers only")
    p.add_argument("--output-dir", default="runs/bench-exact-verify")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    try:
        for d in dtypes:
            check_dtype_name(d, "--dtypes")
        num_tokens = sorted({int(n) for n in args.num_tokens.split(",") if n})
    except ValueError as exc:
        p.error(str(exc))
    if not num_tokens or num_tokens[0] < 1:
        p.error(f"--num-tokens: expected integers >= 1, got {args.num_tokens!r}")
    if args.context < 1 or args.rounds < 1 or args.prompts < 1:
        p.error("--context, --rounds and --prompts must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from deepspec.target.load import load_target

    device = torch.device("cpu")
    results = {"target": args.target, "cpu": device_model_name(device), "threads": torch.get_num_threads(),
               "context": args.context, "rounds": args.rounds, "prompts": args.prompts, "torch": torch.__version__,
               "dtypes": {}}
    print(f"{args.target} on {results['cpu']} ({results['threads']} threads), torch {torch.__version__}, context "
          f"{args.context}; times: median of {args.rounds} interleaved rounds; differences: {args.prompts} prompts, "
          "the n-token forward against n one-token forwards")
    for name in dtypes:
        dtype = resolve_dtype(name, device)
        model, tokenizer = load_target(args.target, dtype=dtype)
        t0 = time.perf_counter()
        exact = {"on": ExactRows(model)}
        setup_s = time.perf_counter() - t0
        if args.breakdown:
            exact |= {"attention": ExactRows(model, linear=False), "linear": ExactRows(model, attention=False)}
        chunk_rows = exact["on"].chunk_rows
        chunked = sorted({f"{n.rsplit('.', 1)[-1]}: {c}" for n, c in chunk_rows.items()})
        med = measure(model, exact, context=args.context, num_tokens=num_tokens, rounds=args.rounds, seed=args.seed)
        diff = differences(model, exact, context=args.context, num_tokens=num_tokens, prompts=args.prompts,
                           seed=args.seed)
        results["dtypes"][dtype_name(dtype)] = {
            "setup_s": setup_s, "chunk_rows": chunk_rows,
            "ms": {pa: {str(n): 1e3 * t for n, t in by_n.items()} for pa, by_n in med.items()},
            "differences": {pa: {str(n): s for n, s in by_n.items()} for pa, by_n in diff.items()},
        }
        print(f"\n{dtype_name(dtype)}: ExactRows set up in {setup_s:.1f} s; rows per F.linear call (row-invariant "
              f"chunk) by layer: {', '.join(chunked)}")
        print(f"{'n':>3}{'off ms':>9}{'on ms':>9}{'on/off':>8}"
              f"{'off: logits differ':>20}{'max':>8}{'argmax':>8}{'on: logits differ':>19}{'max':>8}{'argmax':>8}")
        for n in num_tokens:
            off, on = med["off"][n], med["on"][n]
            d0, d1 = diff["off"][n], diff["on"][n]
            print(f"{n:>3}{1e3 * off:>9.1f}{1e3 * on:>9.1f}{on / off:>8.2f}"
                  f"{d0['logits']:>20.3f}{d0['max']:>8.2g}{d0['argmax']:>8.3f}"
                  f"{d1['logits']:>19.3f}{d1['max']:>8.2g}{d1['argmax']:>8.3f}")
        if args.breakdown:
            print("exact rows for one op only (on/off: its time over off; differ: fraction of logits that differ)")
            print(f"{'n':>3}" + "".join(f"{b + ' on/off':>18}{b + ' differ':>18}" for b in BREAKDOWN))
            for n in num_tokens:
                print(f"{n:>3}" + "".join(f"{med[b][n] / med['off'][n]:>18.2f}{diff[b][n]['logits']:>18.3f}"
                                          for b in BREAKDOWN))
        if args.lossless:
            check = lossless(model, tokenizer, max_new_tokens=args.lossless)
            results["dtypes"][dtype_name(dtype)]["lossless"] = check
            print(f"greedy, {args.lossless} tokens, {len(LOSSLESS_PROMPTS)} chat prompts, a draft proposing the "
                  "target-only output (K = 7): " + "; ".join(
                      f"exact {p}: {c['identical']}/{len(LOSSLESS_PROMPTS)} identical to target-only, "
                      f"{c['accepted']}/{c['proposed']} drafts accepted" for p, c in check.items()))
        del model, exact
    out = Path(args.output_dir)
    atomic_write_json(out / "exact_verify.json", results)
    print(f"\nwrote {out / 'exact_verify.json'}")
    return results


if __name__ == "__main__":
    main()
