"""Training benchmark: tokens/s per drafting algorithm, and dense vs flex block attention.

Measured side by side in one run (interleaved repetitions, medians), on the embedded default
target's shapes with random target features (speed does not depend on their values):

1. ``train``: one optimizer step (prepare, weight, loss, backward, AdamW as the training loop builds
   it: fused) of every registered algorithm (``deepspec.algorithms.registry``) on the same batch, the
   DSpark step once more with the default per-tensor AdamW loop, and the Eagle3 step once more with its
   TTT forward over every row instead of the sampled chains' rows only; with ``--draft-vocab-size``, the
   DSpark and Eagle3 steps once more without the cache's target-logit statistics (a format-2 cache or
   online mode: the target side computes V logits per supervised slot instead of W); tokens/s counts
   the batch's real (unpadded) tokens. Eagle3 unrolls ``ttt_steps`` forwards per step, DSpark/DFlash run one
   block-parallel forward over ``num_anchors`` blocks, so the figures price a step, not quality.
2. ``attention``: DSpark's ``forward_train`` with the dense SDPA mask against the flex_attention
   BlockMask (forward only; flex has no CPU backward), same inputs.
3. On a CUDA machine only (``--qwen3-4b``): step time and peak memory of a Qwen3-4B-shaped DSpark
   draft (random weights, hidden 2560, 5 target layers, flex attention).

Writes ``train_bench.json`` and ``train_bench.png`` under ``--output-dir``.

    python bench/train.py --batch-size 2 --seq-len 384 --repeats 3 --output-dir runs/bench-train
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.algorithms.protocol import TrainBatch  # noqa: E402
from deepspec.algorithms.registry import ALGORITHMS, get_algorithm  # noqa: E402
from deepspec.target.capture import default_target_layer_ids, target_logit_stats  # noqa: E402
from deepspec.train.loop import TrainConfig, build_optimizer  # noqa: E402
from deepspec.utils import pyplot, save_png  # noqa: E402


def _batch(target, n: int, batch_size: int, seq_len: int, device, generator) -> TrainBatch:
    """A right-padded batch: lengths from seq_len/2 to seq_len, the first quarter of each sample
    unsupervised, with the target-logit statistics a format-3 cache stores (of the random final hidden
    states, :func:`deepspec.target.capture.target_logit_stats`)."""
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    lengths = torch.linspace(seq_len // 2, seq_len, batch_size).long().tolist()
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, length // 4: length] = 1
        ids[b, length:] = 0
    feats = torch.randn(batch_size, seq_len, n * hidden, generator=generator)
    last = torch.randn(batch_size, seq_len, hidden, generator=generator)
    stats = [target_logit_stats(target, last[b], mask[b]) for b in range(batch_size)]
    lse = torch.stack([lse_T for lse_T, _ in stats])
    argmax = torch.stack([argmax_T for _, argmax_T in stats]).long()
    return TrainBatch(ids.to(device), mask.to(device), feats.to(device), last.to(device), list(range(batch_size)),
                      lse.to(device), argmax.to(device))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(algo, model, batch, cfg, device, *, fused: bool = True):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg, fused=fused)  # as the training loop builds it
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        t0 = time.perf_counter()
        prepared = algo.prepare(model, batch, generator, cfg)
        out = algo.loss(model, prepared, weight_sum=algo.weight(model, prepared), autocast=autocast)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0

    return step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="target whose shapes the drafts take (default: SmolLM2)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--block-size", type=int, default=7, help="draft slots per block (Eagle3: TTT steps)")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="a reduced draft vocabulary of N ids (drawn at random: speed does not depend on which); 0 = full")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--qwen3-4b", action="store_true", help="CUDA only: also time a Qwen3-4B-shaped DSpark draft")
    p.add_argument("--output-dir", default="runs/bench-train")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from deepspec.target.load import load_target

    target, tokenizer = load_target(args.target)
    target.to(device)
    L, H, V = target.config.num_hidden_layers, target.config.hidden_size, target.config.vocab_size
    layer_ids = default_target_layer_ids(L)
    generator = torch.Generator().manual_seed(0)
    batch = _batch(target, len(layer_ids), args.batch_size, args.seq_len, device, generator)
    num_tokens = int((batch.input_ids_BS != 0).sum())  # real tokens (padding is id 0 here)
    d2t_size = args.draft_vocab_size or None
    d2t = None if d2t_size is None else torch.randperm(V, generator=generator)[:d2t_size].sort().values
    cfg = lambda algorithm: TrainConfig(online_data="unused.jsonl", output_dir="unused", algorithm=algorithm,  # noqa: E731
                                        num_anchors=args.num_anchors, markov_rank=args.markov_rank,
                                        block_size=args.block_size, draft_vocab_size=d2t_size,
                                        batch_size=args.batch_size)

    steps = {}
    for name in ALGORITHMS:
        algo = get_algorithm(name)
        c = cfg(name)
        torch.manual_seed(0)
        model = algo.build(target, tokenizer, c, layer_ids, d2t=d2t).to(device)
        model.train()
        steps[name] = _step_fn(algo, model, batch, c, device)
        steps[name]()  # warm-up
    # the same DSpark step with the default per-tensor AdamW loop instead of the fused kernel
    torch.manual_seed(0)
    model = get_algorithm("dspark").build(target, tokenizer, cfg("dspark"), layer_ids, d2t=d2t).to(device).train()
    steps[UNFUSED] = _step_fn(get_algorithm("dspark"), model, batch, cfg("dspark"), device, fused=False)
    steps[UNFUSED]()
    # the same Eagle3 step (same sampled chains, same loss) with the TTT forward over every row
    torch.manual_seed(0)
    model = get_algorithm("eagle3").build(target, tokenizer, cfg("eagle3"), layer_ids, d2t=d2t).to(device).train()
    every_row = type(model).forward_train
    model.forward_train = lambda ids, feats, steps=None, rows_BS=None: every_row(model, ids, feats, steps)
    steps[EAGLE3_ALL_ROWS] = _step_fn(get_algorithm("eagle3"), model, batch, cfg("eagle3"), device)
    steps[EAGLE3_ALL_ROWS]()
    if d2t is not None:  # the same steps when the batch has no target-logit statistics (V-way target logits)
        no_stats = dataclasses.replace(batch, target_logsumexp_BS=None, target_argmax_BS=None)
        for name in ("dspark", "eagle3"):
            torch.manual_seed(0)
            model = get_algorithm(name).build(target, tokenizer, cfg(name), layer_ids, d2t=d2t).to(device).train()
            steps[NO_STATS.format(name)] = _step_fn(get_algorithm(name), model, no_stats, cfg(name), device)
            steps[NO_STATS.format(name)]()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(step())
    train = {name: {"median_step_s": statistics.median(t), "tok_per_s": num_tokens / statistics.median(t)}
             for name, t in times.items()}

    # dense vs flex forward (DSpark), same inputs
    algo = get_algorithm("dspark")
    torch.manual_seed(0)
    model = algo.build(target, tokenizer, cfg("dspark"), layer_ids, d2t=d2t).to(device).eval()
    prepared = algo.prepare(model, batch, torch.Generator().manual_seed(0), cfg("dspark"))
    attention: dict[str, list[float]] = {"dense": [], "flex": []}

    def forward(use_flex: bool) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.forward_train(batch.input_ids_BS, batch.target_hidden_BSF, prepared.anchor_pos_BA,
                                prepared.block_valid_BA, use_flex=use_flex)
        _sync(device)
        return time.perf_counter() - t0

    forward(False), forward(True)  # warm-up
    for _ in range(args.repeats):
        for mode in attention:
            attention[mode].append(forward(mode == "flex"))
    attention_median = {m: statistics.median(v) for m, v in attention.items()}

    qwen = None
    if args.qwen3_4b:
        if device.type != "cuda":
            qwen = {"note": "needs CUDA; not run"}
        else:
            qwen = _qwen3_shaped_step(args, device, QWEN3_4B)

    result = {"target": args.target, "device": str(device), "threads": torch.get_num_threads(),
              "batch_size": args.batch_size, "seq_len": args.seq_len, "num_tokens": num_tokens,
              "num_anchors": args.num_anchors, "train": train, "train_step_times_s": times,
              "forward_s": attention_median, "forward_times_s": attention, "qwen3_4b": qwen}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    _plot(result, out / "train_bench.png")
    print(f"{args.target} on {device}, {torch.get_num_threads()} threads; batch {args.batch_size} x {args.seq_len} "
          f"({num_tokens} real tokens), {args.num_anchors} anchors")
    print(f"{'algorithm':<28}{'step s':>10}{'tok/s':>10}")
    for name, r in train.items():
        print(f"{name:<28}{r['median_step_s']:>10.3f}{r['tok_per_s']:>10.1f}")
    print(f"DSpark forward: dense {attention_median['dense']:.3f} s, flex {attention_median['flex']:.3f} s "
          f"(flex / dense {attention_median['flex'] / attention_median['dense']:.2f})")
    if qwen is not None:
        print(f"Qwen3-4B-shaped DSpark draft: {qwen}")
    print(f"wrote {out / 'train_bench.json'} and {out / 'train_bench.png'}")
    return result


UNFUSED = "dspark, unfused AdamW"
EAGLE3_ALL_ROWS = "eagle3, TTT over every row"
NO_STATS = "{}, V-way target logits"

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000, tie_word_embeddings=True)


def _qwen3_shaped_step(args, device, shape: dict, *, seq_len: int = 4096, num_anchors: int = 512) -> dict:
    """Step time and peak memory of a DSpark draft for a Qwen3 target of ``shape`` (random weights;
    the target's decoder is never run: only its config, embedding and lm_head are read), flex attention
    on CUDA. Uses the real Qwen3 tokenizer from ``../shared/tokenizers/qwen3`` for the mask token."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok_dir = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3"
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"{tok_dir}: the Qwen3 tokenizer is needed for the Qwen3-shaped draft")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = Qwen3Config(**{**shape, "num_hidden_layers": 4})  # the draft reads only embedding, lm_head, config
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    target.config.num_hidden_layers = shape["num_hidden_layers"]  # layer ids as for the real depth
    layer_ids = default_target_layer_ids(shape["num_hidden_layers"])
    algo = get_algorithm("dspark")
    c = TrainConfig(online_data="unused.jsonl", output_dir="unused", num_anchors=num_anchors, batch_size=1,
                    dtype="bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    model = algo.build(target, tokenizer, c, layer_ids).to(device).train()
    batch = _batch(target, len(layer_ids), 1, seq_len, device, torch.Generator().manual_seed(0))
    del target
    step = _step_fn(algo, model, batch, c, device)
    step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(args.repeats)]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"median_step_s": statistics.median(times), "peak_memory_gib": peak, "seq_len": seq_len,
            "num_anchors": num_anchors, "hidden_size": shape["hidden_size"]}


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["train"])
    ax_t.bar(names, [result["train"][n]["tok_per_s"] for n in names])
    ax_t.set_ylabel("training tokens/s (median)")
    ax_t.set_title(f"{result['device']}, batch {result['batch_size']} x {result['seq_len']}")
    modes = list(result["forward_s"])
    ax_a.bar(modes, [result["forward_s"][m] for m in modes], color=["#37a", "#a73"])
    ax_a.set_ylabel("DSpark forward s (median)")
    ax_a.set_title("block attention: dense SDPA vs flex")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
