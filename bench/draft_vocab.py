"""Reduced draft vocabulary benchmark: DSpark training step and propose time against the draft vocabulary size.

Side by side in one run on the embedded default target (SmolLM2-135M, V = 49,152), interleaved
repetitions, medians:

1. ``train``: one DSpark optimizer step (prepare, weight, loss, backward, AdamW; the step of
   ``bench/train.py``) on the same random batch, for every ``--draft-vocab-sizes`` N and the full
   vocabulary. The loss still scores the target distribution over all V (L1 needs the target's mass
   outside the draft vocabulary), so only the draft's own output layer, its softmax and backward shrink.
2. ``propose``: ``DSparkProposer.propose`` (block forward + ``block_size`` serial Markov slots) with
   ``--context`` tokens of real target features already in the draft's context (the tokens of a
   gsm8k prompt, repeated to length), greedy and at temperature 1.

Drafts are untrained (speed does not depend on the weights); the draft vocabulary is the prompt's
tokens first, then the smallest ids (which ids does not change the cost). Writes
``draft_vocab_bench.json`` under ``--output-dir``.

    python bench/draft_vocab.py --draft-vocab-sizes 4096 8192 16384 --repeats 5 --output-dir runs/bench-vocab
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.algorithms.dspark.proposer import DSparkProposer  # noqa: E402
from deepspec.algorithms.registry import get_algorithm  # noqa: E402
from deepspec.decoding.verify import SamplingParams  # noqa: E402
from deepspec.models.vocab import count_supervised_tokens, select_draft_vocab  # noqa: E402
from deepspec.target.capture import default_target_layer_ids, target_forward  # noqa: E402
from deepspec.train.config import TrainConfig  # noqa: E402


def _train_bench():
    """bench/train.py as a module (its batch builder and step function)."""
    spec = importlib.util.spec_from_file_location("bench_train", Path(__file__).with_name("train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--context", type=int, default=300, help="context tokens before the anchor when proposing")
    p.add_argument("--propose-calls", type=int, default=10, help="propose calls per repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--output-dir", default="runs/bench-vocab")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from deepspec.data.chat import render_prompt
    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.target.load import load_target

    bench_train = _train_bench()
    target, tokenizer = load_target("default")
    target.to(device)
    L, H, V = target.config.num_hidden_layers, target.config.hidden_size, target.config.vocab_size
    layer_ids = default_target_layer_ids(L)
    prompt_ids = render_prompt(tokenizer, load_benchmark("gsm8k", max_samples=1)[0].messages)
    context_ids = (prompt_ids * (args.context // len(prompt_ids) + 2))[: args.context + 1]
    counts_V = count_supervised_tokens([{"input_ids": torch.tensor(prompt_ids),
                                         "loss_mask": torch.ones(len(prompt_ids))}], V)
    with torch.no_grad():
        feats_TF = target_forward(target, torch.tensor([context_ids], device=device),
                                  layer_ids).target_hidden_BTF[0, : args.context].float()

    algo = get_algorithm("dspark")
    sizes: list[int | None] = [*args.draft_vocab_sizes, None]
    label = {n: f"N={n}" if n else f"full V={V}" for n in sizes}
    batch = bench_train._batch(V, H, len(layer_ids), args.batch_size, args.seq_len, device,
                               torch.Generator().manual_seed(0))
    num_tokens = int((batch.input_ids_BS != 0).sum())
    steps, proposers = {}, {}
    for n in sizes:
        cfg = TrainConfig(online_data="unused.jsonl", output_dir="unused", num_anchors=args.num_anchors,
                          markov_rank=args.markov_rank, batch_size=args.batch_size, draft_vocab_size=n)
        torch.manual_seed(0)
        d2t = select_draft_vocab(counts_V, n) if n else None
        model = algo.build(target, tokenizer, cfg, layer_ids, d2t=d2t).to(device).train()
        steps[n] = bench_train._step_fn(algo, model, batch, cfg, device)
        steps[n]()  # warm-up
        proposer = DSparkProposer(_eval_copy(algo, target, tokenizer, cfg, layer_ids, d2t, model, device))
        proposer.extend_context(feats_TF, context_ids[: args.context])
        proposers[n] = proposer

    anchor = context_ids[args.context]
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    generator = torch.Generator(device=device).manual_seed(0)

    def propose_ms(n, sampling) -> float:
        t0 = time.perf_counter()
        for _ in range(args.propose_calls):
            proposers[n].propose(anchor, args.context, sampling=sampling, generator=generator)
        bench_train._sync(device)
        return (time.perf_counter() - t0) / args.propose_calls * 1e3

    for n in sizes:  # warm-up
        propose_ms(n, greedy), propose_ms(n, sampled)
    times = {n: {"train_step_s": [], "propose_greedy_ms": [], "propose_t1_ms": []} for n in sizes}
    for _ in range(args.repeats):
        for n in sizes:
            times[n]["train_step_s"].append(steps[n]())
            times[n]["propose_greedy_ms"].append(propose_ms(n, greedy))
            times[n]["propose_t1_ms"].append(propose_ms(n, sampled))
    medians = {label[n]: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    result = {"device": str(device), "threads": torch.get_num_threads(), "vocab_size": V,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "num_tokens": num_tokens,
              "num_anchors": args.num_anchors, "markov_rank": args.markov_rank, "context": args.context,
              "block_size": TrainConfig.__dataclass_fields__["block_size"].default, "repeats": args.repeats,
              "median": medians, "times": {label[n]: t for n, t in times.items()}}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_vocab_bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    full = medians[label[None]]
    print(f"SmolLM2 on {device}, {torch.get_num_threads()} threads; train batch {args.batch_size} x {args.seq_len} "
          f"({num_tokens} tokens), {args.num_anchors} anchors, Markov rank {args.markov_rank}; propose after "
          f"{args.context} context tokens; medians of {args.repeats}")
    print(f"{'draft vocab':<16}{'train step s':>14}{'vs full':>9}{'propose ms (T=0)':>18}{'vs full':>9}"
          f"{'propose ms (T=1)':>18}{'vs full':>9}")
    for name, m in medians.items():
        print(f"{name:<16}{m['train_step_s']:>14.3f}{m['train_step_s'] / full['train_step_s']:>9.2f}"
              f"{m['propose_greedy_ms']:>18.1f}{m['propose_greedy_ms'] / full['propose_greedy_ms']:>9.2f}"
              f"{m['propose_t1_ms']:>18.1f}{m['propose_t1_ms'] / full['propose_t1_ms']:>9.2f}")
    print(f"wrote {out / 'draft_vocab_bench.json'}")
    return result


def _eval_copy(algo, target, tokenizer, cfg, layer_ids, d2t, trained, device):
    """A second draft of the same shape in eval mode (the training one keeps its optimizer state)."""
    torch.manual_seed(0)
    model = algo.build(target, tokenizer, cfg, layer_ids, d2t=d2t).to(device)
    model.load_state_dict(trained.state_dict())
    return model.eval()


if __name__ == "__main__":
    main()
