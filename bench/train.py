"""Training benchmark: tokens/s per drafting algorithm, dense vs flex block attention, and the
DSpark step of a Qwen3-4B-shaped draft with its MFU.

Default mode, measured side by side in one run (interleaved repetitions, medians), on the embedded
default target's shapes with random target features (speed does not depend on their values):

1. ``train``: one optimizer step (prepare, weight, loss, backward, AdamW as the training loop builds
   it: fused) of every registered algorithm (``deepspec.algorithms.registry``) on the same batch, the
   DSpark step once more with the default per-tensor AdamW loop, once more with the chunked head loss
   (``--chunked-head-loss on``: draft logits per chunk of slots, recomputed in backward), and the Eagle3
   step once more with its TTT forward over every row instead of the sampled chains' rows only; with
   ``--draft-vocab-size``, the DSpark and Eagle3 steps once more without the cache's target-logit
   statistics (as online mode: the target side computes V logits per supervised slot
   instead of W); tokens/s counts the batch's real (unpadded) tokens. Eagle3 unrolls ``ttt_steps``
   forwards per step, DSpark/DFlash run one block-parallel forward over ``num_anchors`` blocks, so the
   figures price a step, not quality. Beside each step: the bytes of the tensors autograd holds for its
   backward (``saved_MiB``; unique storages, outside checkpointed regions: the inputs a checkpoint keeps are not
   seen, so a chunked head loss's figure leaves out its ``[N, D]`` slot hidden states), the memory a step needs
   beyond the weights.
2. ``attention``: DSpark's ``forward_train`` with the dense SDPA mask against the flex_attention
   BlockMask (forward only; flex has no CPU backward), same inputs.

``--qwen3-4b`` (standalone: loads no target, reads the real Qwen3 tokenizer from the repo's test
fixtures): the qwen3-4b recipe's DSpark draft (5 layers, block 7, Markov rank 256; ``--qwen3-draft-layers``)
for a Qwen3-4B-shaped target (random weights, hidden 2560, vocab 151,936, 5 target layers; flex attention and bf16 autocast on CUDA) with the head loss materialised and
chunked: step time, tokens/s, peak memory (CUDA), FLOPs by an analytic count and MFU against the
chip's dense bf16 peak (``--peak-tflops``; known for H100/H200/A100/B200). On a CPU it runs too, at
the sizes given (``--qwen3-seq-len``, ``--qwen3-num-anchors``), without MFU.

Writes ``train_bench.json`` and ``train_bench.png`` under ``--output-dir`` (``--qwen3-4b``:
``train_bench_qwen3_4b.json`` / ``.png``).

    python bench/train.py --batch-size 2 --seq-len 384 --repeats 3 --output-dir runs/bench-train
    python bench/train.py --qwen3-4b --repeats 5 --output-dir runs/bench-train   # on a GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.algorithms.protocol import TrainBatch  # noqa: E402
from deepspec.algorithms.registry import ALGORITHMS, get_algorithm  # noqa: E402
from deepspec.device import allow_tf32, resolve_device  # noqa: E402
from deepspec.target.capture import default_target_layer_ids, target_logit_stats  # noqa: E402
from deepspec.train.config import TrainConfig  # noqa: E402
from deepspec.train.data import to_device  # noqa: E402
from deepspec.train.loop import build_optimizer  # noqa: E402
from deepspec.utils import pyplot, save_png  # noqa: E402


def _batch(target, n: int, batch_size: int, seq_len: int, generator) -> TrainBatch:
    """A right-padded CPU batch (the trainer samples anchors on the CPU, then moves the micro-batch):
    lengths from seq_len down to seq_len/2, the first quarter of each sample unsupervised, with the
    target-logit statistics the target cache stores (of the random final hidden states,
    :func:`deepspec.target.capture.target_logit_stats`)."""
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    lengths = torch.linspace(seq_len, seq_len // 2, batch_size).long().tolist()  # batch 1: the whole seq_len
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, length // 4: length] = 1
        ids[b, length:] = 0
    feats = torch.randn(batch_size, seq_len, n * hidden, generator=generator)
    last = torch.randn(batch_size, seq_len, hidden, generator=generator)
    stats = [target_logit_stats(target, last[b].to(target.lm_head.weight.device), mask[b]) for b in range(batch_size)]
    lse = torch.stack([lse_T for lse_T, _ in stats]).cpu()
    argmax = torch.stack([argmax_T for _, argmax_T in stats]).long().cpu()
    return TrainBatch(ids, mask, feats, last, list(range(batch_size)), lse, argmax)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(algo, model, batch, cfg, device, *, fused: bool = True, optimizer=None, use_flex: bool | None = None):
    """One training step of ``algo`` on the CPU ``batch`` as the trainer runs it (prepare on the CPU,
    move, weight, loss, backward, AdamW), timed; ``step.saved_bytes`` afterwards holds the bytes of the
    tensors autograd kept for the backward of the last step, ``step.last`` its prepared micro-batch.
    ``use_flex`` (DSpark/DFlash): force the flex BlockMask (True) or the dense SDPA mask (False); None
    keeps the model's default (flex on CUDA)."""
    if optimizer is None:  # as the training loop builds it
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg, fused=fused)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def step() -> float:
        t0 = time.perf_counter()
        prepared = to_device(algo.prepare(model, batch, generator, cfg), device)
        saved = _SavedBytes(weights)
        with saved, _attention_mode(model, use_flex):
            out = algo.loss(model, prepared, weight_sum=algo.weight(model, prepared), autocast=autocast)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step.saved_bytes, step.last = saved.bytes, prepared
        return time.perf_counter() - t0

    return step


@contextlib.contextmanager
def _attention_mode(model, use_flex: bool | None):
    """``model.forward_train`` with ``use_flex`` fixed for the ``with`` block (nothing when None)."""
    if use_flex is None:
        yield
        return
    model.forward_train = functools.partial(type(model).forward_train, model, use_flex=use_flex)
    try:
        yield
    finally:
        del model.forward_train


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd saves for backward inside the ``with`` block
    (tensors saved inside a checkpointed region are not saved: they are recomputed)."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.bytes = 0
        seen = set(exclude)  # storages not to count (the model's own weights)

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


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
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda[:N]")
    p.add_argument("--qwen3-4b", action="store_true",
                   help="only the Qwen3-4B-shaped DSpark draft (standalone: no target is loaded)")
    p.add_argument("--qwen3-seq-len", type=int, default=4096)
    p.add_argument("--qwen3-num-anchors", type=int, default=512)
    p.add_argument("--qwen3-batch-size", type=int, default=1)
    p.add_argument("--qwen3-draft-layers", type=int, default=5, help="draft layers (the qwen3-4b recipe's: 5)")
    p.add_argument("--qwen3-dense", action="store_true",
                   help="--qwen3-4b: time the chunked step once more with the dense SDPA mask beside flex (CUDA)")
    p.add_argument("--profile", action="store_true",
                   help="--qwen3-4b: profile one chunked step and print its top CUDA kernels (by self CUDA time)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the chip's dense bf16 peak for MFU (default: known for H100/H200/A100/B200; none on a CPU)")
    p.add_argument("--output-dir", default="runs/bench-train")
    args = p.parse_args(argv)
    for flag in ("batch_size", "seq_len", "num_anchors", "block_size", "repeats", "qwen3_seq_len",
                 "qwen3_num_anchors", "qwen3_batch_size", "qwen3_draft_layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    if args.qwen3_seq_len < 4:
        p.error(f"--qwen3-seq-len: expected at least 4 tokens (a quarter unsupervised, then anchors), got "
                f"{args.qwen3_seq_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device, "--device")
    except ValueError as exc:
        p.error(str(exc))
    if device.type == "cuda":
        allow_tf32()  # as the trainer does on CUDA
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.qwen3_4b:
        return _qwen3_main(args, device, out)

    from deepspec.target.load import load_target

    target, tokenizer = load_target(args.target)
    target.to(device)
    L, H, V = target.config.num_hidden_layers, target.config.hidden_size, target.config.vocab_size
    layer_ids = default_target_layer_ids(L)
    generator = torch.Generator().manual_seed(0)
    batch = _batch(target, len(layer_ids), args.batch_size, args.seq_len, generator)
    num_tokens = int((batch.input_ids_BS != 0).sum())  # real tokens (padding is id 0 here)
    d2t_size = args.draft_vocab_size or None
    d2t = None if d2t_size is None else torch.randperm(V, generator=generator)[:d2t_size].sort().values
    cfg = lambda algorithm, **kw: TrainConfig(online_data="unused.jsonl", output_dir="unused", algorithm=algorithm,  # noqa: E731
                                              num_anchors=args.num_anchors, markov_rank=args.markov_rank,
                                              block_size=args.block_size, draft_vocab_size=d2t_size,
                                              ttt_steps=args.block_size, num_chains=args.num_anchors,  # Eagle3's
                                              batch_size=args.batch_size, **kw)

    def build(name: str, **kw):
        torch.manual_seed(0)
        return get_algorithm(name).build(target, tokenizer, cfg(name, **kw), layer_ids, d2t=d2t).to(device).train()

    steps = {}
    for name in ALGORITHMS:
        steps[name] = _step_fn(get_algorithm(name), build(name), batch, cfg(name), device)
    # the same DSpark step with the default per-tensor AdamW loop instead of the fused kernel
    steps[UNFUSED] = _step_fn(get_algorithm("dspark"), build("dspark"), batch, cfg("dspark"), device, fused=False)
    # ... and with the draft logits computed per chunk of slots in the loss (recomputed in backward)
    steps[CHUNKED] = _step_fn(get_algorithm("dspark"), build("dspark"), batch, cfg("dspark", chunked_head_loss="on"),
                              device)
    # the same Eagle3 step (same sampled chains, same loss) with the TTT forward over every row
    model = build("eagle3")
    every_row = type(model).forward_train
    model.forward_train = lambda ids, feats, steps=None, rows_BS=None: every_row(model, ids, feats, steps)
    steps[EAGLE3_ALL_ROWS] = _step_fn(get_algorithm("eagle3"), model, batch, cfg("eagle3"), device)
    if d2t is not None:  # the same steps when the batch has no target-logit statistics (V-way target logits)
        no_stats = dataclasses.replace(batch, target_logsumexp_BS=None, target_argmax_BS=None)
        for name in ("dspark", "eagle3"):
            steps[NO_STATS.format(name)] = _step_fn(get_algorithm(name), build(name), no_stats, cfg(name), device)
    for step in steps.values():
        step()  # warm-up
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(step())
    train = {name: {"median_step_s": statistics.median(t), "tok_per_s": num_tokens / statistics.median(t),
                    "saved_MiB": steps[name].saved_bytes / 2**20}
             for name, t in times.items()}

    # dense vs flex forward (DSpark), same inputs
    algo = get_algorithm("dspark")
    model = build("dspark").eval()
    prepared = to_device(algo.prepare(model, batch, torch.Generator().manual_seed(0), cfg("dspark")), device)
    b = prepared.batch
    attention: dict[str, list[float]] = {"dense": [], "flex": []}

    def forward(use_flex: bool) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.forward_train(b.input_ids_BS, b.target_hidden_BSF, prepared.anchor_pos_BA, prepared.block_valid_BA,
                                use_flex=use_flex)
        _sync(device)
        return time.perf_counter() - t0

    forward(False), forward(True)  # warm-up
    for _ in range(args.repeats):
        for mode in attention:
            attention[mode].append(forward(mode == "flex"))
    attention_median = {m: statistics.median(v) for m, v in attention.items()}

    result = {"target": args.target, "device": str(device), "threads": torch.get_num_threads(),
              "batch_size": args.batch_size, "seq_len": args.seq_len, "num_tokens": num_tokens,
              "num_anchors": args.num_anchors, "train": train, "train_step_times_s": times,
              "forward_s": attention_median, "forward_times_s": attention}
    (out / "train_bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    _plot(result, out / "train_bench.png")
    print(f"{args.target} on {device}, {torch.get_num_threads()} threads; batch {args.batch_size} x {args.seq_len} "
          f"({num_tokens} real tokens), {args.num_anchors} anchors")
    print(f"{'algorithm':<28}{'step s':>10}{'tok/s':>10}{'saved MiB':>11}")
    for name, r in train.items():
        print(f"{name:<28}{r['median_step_s']:>10.3f}{r['tok_per_s']:>10.1f}{r['saved_MiB']:>11.1f}")
    print(f"DSpark forward: dense {attention_median['dense']:.3f} s, flex {attention_median['flex']:.3f} s "
          f"(flex / dense {attention_median['flex'] / attention_median['dense']:.2f})")
    print(f"wrote {out / 'train_bench.json'} and {out / 'train_bench.png'}")
    return result


UNFUSED = "dspark, unfused AdamW"
CHUNKED = "dspark, chunked head loss"
EAGLE3_ALL_ROWS = "eagle3, TTT over every row"
NO_STATS = "{}, V-way target logits"
DENSE = "on, dense mask"
MODE_NAMES = {"off": "materialised", "on": "chunked", DENSE: "chunked dense"}

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000, tie_word_embeddings=True)

# dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name()
DENSE_BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "B200": 2250e12, "A100": 312e12}


def _peak_flops(args, device) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DENSE_BF16_PEAK.items() if key in name), None)


def dspark_step_flops(config, anchor_pos_BA: torch.Tensor, block_valid_BA: torch.Tensor, seq_len: int,
                      num_valid_slots: int, target_vocab: int, *, attention: str = "visible") -> float:
    """Analytic FLOPs of one DSpark/DFlash training step (forward + backward; 2 per multiply-add).

    Forward: ``fc`` over the ``B x S`` context; per draft layer the context K/V projections, the block's
    Q/K/V/O projections and MLP over ``A x K`` slots, and attention over each block's visible keys (the
    context keys before its anchor, ``a``, plus the block's ``K``: the useful part of the mask, not the
    dense ``S + A*K``); the draft's output layer (``lm_head`` and the Markov head's ``r x W``) and the
    target's (``H x target_vocab``, no gradient) over the ``num_valid_slots`` supervised slots.
    Backward: twice the forward for trainable layers, the frozen ``lm_head`` once (input gradient only),
    ``fc`` once (weight gradient only: the features need none), the target side nothing; the
    recomputation of a chunked head loss is not counted (MFU counts the model's FLOPs, not the
    implementation's). Anchors are ``[B, A]``; invalid (padding) blocks count nothing. ``attention``
    ``dense``: every query against all ``S + A*K`` keys, as the dense SDPA mask computes (what
    ``torch.utils.flop_counter`` counts; the test of this function). The confidence head is counted too."""
    c = config
    D, K, W = c.hidden_size, c.block_size, c.output_vocab_size
    d, Hq, Hk = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inter = c.to_hf_config().intermediate_size
    B = anchor_pos_BA.shape[0]
    valid = block_valid_BA.bool()
    blocks = int(valid.sum())
    Q = blocks * K
    if attention == "dense":
        visible = float(B * anchor_pos_BA.shape[1] * K * (seq_len + anchor_pos_BA.shape[1] * K))
    else:  # sum over the valid blocks' queries of the keys they see: context keys < a, and the block's K
        visible = float(((anchor_pos_BA.float() + K) * valid).sum()) * K
    per_layer_trainable = (2 * B * seq_len * D * 2 * Hk * d + 2 * Q * D * (Hq * d + 2 * Hk * d) + 2 * Q * Hq * d * D
                           + 2 * Q * 3 * D * inter)
    attn = 2 * 2 * Hq * d * visible
    fc = 2 * B * seq_len * c.feature_width * D
    N = num_valid_slots
    rank = c.markov_rank if c.use_markov_head else 0
    lm_head, markov = 2 * N * D * W, 2 * N * rank * W
    target_side = 2 * N * D * target_vocab
    confidence = 2 * N * (D + rank) if c.use_confidence_head else 0
    forward = c.num_draft_layers * (per_layer_trainable + attn) + fc + lm_head + markov + confidence + target_side
    backward = 2 * c.num_draft_layers * (per_layer_trainable + attn) + fc + lm_head + 2 * (markov + confidence)
    return float(forward + backward)


def _qwen3_main(args, device, out: Path) -> dict:
    """``--qwen3-4b``: a DSpark draft for a Qwen3-4B-shaped target (random weights; the target's decoder
    is never run: only its config, embedding and lm_head are read), its head loss materialised and
    chunked, timed interleaved; on CUDA with flex attention and bf16 autocast. The real Qwen3 tokenizer
    (for the mask token) comes from ``tests/fixtures/qwen3_tokenizer``."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.helpers import qwen3_tokenizer_dir

    shape = QWEN3_4B
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    config = Qwen3Config(**{**shape, "num_hidden_layers": 1})  # the draft reads only embedding, lm_head, config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype)
    target.config.num_hidden_layers = shape["num_hidden_layers"]  # layer ids as for the real depth
    layer_ids = default_target_layer_ids(shape["num_hidden_layers"])
    algo = get_algorithm("dspark")
    B, S, A = args.qwen3_batch_size, args.qwen3_seq_len, args.qwen3_num_anchors
    batch = _batch(target, len(layer_ids), B, S, torch.Generator().manual_seed(0))
    if device.type == "cuda":  # as the trainer reads the recipe's bf16 cache: stored dtype, pinned, upcast on the GPU
        batch = dataclasses.replace(
            batch, target_hidden_BSF=batch.target_hidden_BSF.bfloat16().pin_memory(),
            target_last_hidden_BSH=batch.target_last_hidden_BSH.bfloat16().pin_memory())
    num_tokens = int((batch.input_ids_BS != 0).sum())
    # one draft and one optimizer for both modes, so each mode's peak memory holds one set of weights
    # and AdamW state (the recipe's draft: 5 layers, block 7, Markov rank 256)
    cfgs = {mode: TrainConfig(online_data="unused.jsonl", output_dir="unused", num_anchors=A, batch_size=B,
                              num_draft_layers=args.qwen3_draft_layers, dtype="bf16" if device.type == "cuda" else "fp32",
                              chunked_head_loss=mode) for mode in ("off", "on")}
    torch.manual_seed(0)
    model = algo.build(target, tokenizer, cfgs["on"], layer_ids).to(device).train()
    del target
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfgs["on"])
    steps = {mode: _step_fn(algo, model, batch, c, device, optimizer=optimizer) for mode, c in cfgs.items()}
    if args.qwen3_dense:  # the chunked step with the dense SDPA mask instead of flex
        steps[DENSE] = _step_fn(algo, model, batch, cfgs["on"], device, optimizer=optimizer, use_flex=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peak = _peak_flops(args, device)
    results: dict[str, dict] = {}
    times: dict[str, list[float]] = {}
    for mode, step in steps.items():
        try:
            step()  # warm-up (compiles flex on CUDA)
            times[mode] = []
        except torch.OutOfMemoryError as exc:
            results[mode] = {"error": f"out of memory: {exc}".splitlines()[0]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for _ in range(args.repeats):
        for mode in times:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[mode].append(steps[mode]())
            if device.type == "cuda":
                results.setdefault(mode, {})["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    for mode, t in times.items():
        prepared = steps[mode].last
        n_valid = _num_valid_slots(model, prepared)
        flops = dspark_step_flops(model.config, prepared.anchor_pos_BA.cpu(), prepared.block_valid_BA.cpu(), S,
                                  n_valid, shape["vocab_size"])
        median = statistics.median(t)
        results.setdefault(mode, {}).update({
            "median_step_s": median, "step_times_s": t, "tok_per_s": num_tokens / median, "tflops_per_step": flops / 1e12,
            "achieved_tflops": flops / median / 1e12, "mfu": None if peak is None else flops / median / peak,
            "saved_MiB": steps[mode].saved_bytes / 2**20, "num_valid_slots": n_valid})
    if args.profile and "on" in times:
        result_profile = _profile_step(steps["on"], device)
    else:
        result_profile = None
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
              "cpu", "profile_top_kernels": result_profile, "dtype": str(dtype).removeprefix("torch."), "batch_size": B, "seq_len": S, "num_anchors": A,
              "num_tokens": num_tokens, "hidden_size": shape["hidden_size"], "vocab_size": shape["vocab_size"],
              "num_draft_layers": args.qwen3_draft_layers,
              "trainable_parameters": trainable, "peak_flops": peak, "chunked_head_loss": results}
    (out / "train_bench_qwen3_4b.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"Qwen3-4B-shaped DSpark draft ({args.qwen3_draft_layers} layers) on {result['device_name']} "
          f"({result['dtype']}): {trainable / 1e6:.1f} M trainable parameters; batch {B} x {S} ({num_tokens} real "
          f"tokens), {A} anchors")
    print(f"{'head loss':<14}{'step s':>9}{'tok/s':>10}{'TFLOP/step':>12}{'TFLOP/s':>9}{'MFU':>8}{'peak GiB':>10}"
          f"{'saved MiB':>11}")
    for mode, r in results.items():
        name = MODE_NAMES[mode]
        if "error" in r:
            print(f"{name:<14}{r['error']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f}"
        print(f"{name:<14}{r['median_step_s']:>9.3f}{r['tok_per_s']:>10.0f}{r['tflops_per_step']:>12.2f}"
              f"{r['achieved_tflops']:>9.1f}{mfu:>8}{mem:>10}{r['saved_MiB']:>11.0f}")
    if result_profile:
        print("top CUDA kernels of one chunked step (self CUDA time):")
        for k in result_profile:
            print(f"  {k['self_cuda_ms']:>8.2f} ms {100 * k['share']:>5.1f}%  x{k['calls']:<5} {k['name'][:90]}")
    _plot_qwen3(result, out / "train_bench_qwen3_4b.png")
    print(f"wrote {out / 'train_bench_qwen3_4b.json'} and {out / 'train_bench_qwen3_4b.png'}")
    return result


def device_time_us(event) -> float:
    """A profiler event's self time on the device, microseconds (torch renamed the field from
    ``self_cuda_time_total`` to ``self_device_time_total``; both versions are read)."""
    t = getattr(event, "self_device_time_total", None)
    return t if t is not None else getattr(event, "self_cuda_time_total", 0.0)


def _profile_step(step, device, top: int = 15) -> list[dict]:
    """One call of ``step`` under ``torch.profiler`` (CPU and CUDA activities): the ``top`` device
    events (kernels, copies, memsets; not the operators that launched them, which would count each
    kernel twice) by device time, each ``{name, self_cuda_ms, share, calls}`` (``share`` of all device
    events' time in the step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    rows = [{"name": e.key, "self_cuda_ms": device_time_us(e) / 1e3, "calls": e.count} for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and device_time_us(e) > 0]
    total = sum(r["self_cuda_ms"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["self_cuda_ms"])
    return [{**r, "share": r["self_cuda_ms"] / total} for r in rows[:top]]


def _num_valid_slots(model, prepared) -> int:
    from deepspec.algorithms.dspark.loss import supervision_mask

    b = prepared.batch
    return int(supervision_mask(b.loss_mask_BS, prepared.anchor_pos_BA, prepared.block_valid_BA,
                                model.config.num_draft_slots).sum())


def _plot_qwen3(result: dict, path: Path) -> None:
    plt = pyplot()
    modes = [m for m, r in result["chunked_head_loss"].items() if "error" not in r]
    names = [MODE_NAMES[m] for m in modes]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 4))
    ax_t.bar(names, [result["chunked_head_loss"][m]["median_step_s"] for m in modes], color="#37a")
    ax_t.set_ylabel("step time, s (median)")
    ax_t.set_title(f"Qwen3-4B-shaped DSpark, {result['device_name']}")
    mem = [result["chunked_head_loss"][m].get("peak_memory_gib") for m in modes]
    if all(v is not None for v in mem):
        ax_m.bar(names, mem, color="#a73")
        ax_m.set_ylabel("peak memory, GiB")
    else:
        ax_m.bar(names, [result["chunked_head_loss"][m]["saved_MiB"] for m in modes], color="#a73")
        ax_m.set_ylabel("saved for backward, MiB")
    ax_m.set_title(f"batch {result['batch_size']} x {result['seq_len']}, {result['num_anchors']} anchors")
    fig.tight_layout()
    save_png(fig, path)


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
