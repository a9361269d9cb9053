"""Target-cache benchmark: capture throughput against a plain target forward, and bytes per token.

Measures, side by side in one run with interleaved repetitions, on the same per-sample inputs
(each sample alone, batch 1, no padding: the capture rule of the cache writer and online mode):

- ``plain``:   the target's base model forward (no hooks, no copies; no lm_head, which capture
               does not run either), under ``torch.no_grad``;
- ``plain-batched``: the same forward on right-padded batches of ``--batch-size`` samples (input
               order; tokens/s counts real tokens only). Not a capture mode (padded batches change
               the low-order bits, see ``capture_sample_features``): it prices the batch-1 rule;
- ``capture``: :func:`deepspec.target.capture.capture_sample_features` (hooks + feature concat);
- ``capture-bfloat16``: the same capture by a bfloat16 copy of the target (``deepspec cache --dtype
               bfloat16``; ``--no-bf16-capture`` skips it);
- ``write``:   the full cache write of the same samples to a temporary folder
               (:func:`deepspec.data.cache.writer.write_target_cache`, float32 storage): rendering,
               capture, device-to-host copy, shard files, checksums, manifest.

It prints tokens/s of each, the capture overhead ``capture_time / plain_time - 1`` (goal: at most
10 %), and bytes per token for each storage mode, measured
on disk and from :func:`deepspec.data.cache.format.cache_bytes_per_token`. Figures are saved as
``cache_bench.json`` and ``cache_bench.png`` under ``--output-dir``.

    python bench/cache.py --num-conversations 8 --max-seq-len 256 --repeats 3 --output-dir runs/bench-cache

Without ``--prepared`` the first ``--num-conversations`` usable ShareGPT demo conversations are
rendered as they are (their original answers; no regeneration: only the token count matters here).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.data.conversations import SkipRow, load_sharegpt_demo, normalise_messages, read_jsonl  # noqa: E402
from deepspec.data.cache.format import cache_bytes_per_token  # noqa: E402
from deepspec.data.cache.samples import iter_prepared_samples  # noqa: E402
from deepspec.data.cache.writer import write_target_cache  # noqa: E402
from deepspec.target.capture import (  # noqa: E402
    _base_model,
    capture_sample_features,
    default_target_layer_ids,
    validate_target_layer_ids,
)
from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint  # noqa: E402
from deepspec.utils import pyplot, save_png  # noqa: E402


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prepared", default=None, help="a prepared JSONL file (default: ShareGPT demo rows)")
    p.add_argument("--num-conversations", type=int, default=8, help="conversations to use (default: 8)")
    p.add_argument("--max-seq-len", type=int, default=256, help="truncate samples to this many tokens (default: 256)")
    p.add_argument("--num-target-layers", type=int, default=5, help="feature layers, evenly spaced (default: 5)")
    p.add_argument("--batch-size", type=int, default=8, help="batch of the plain-batched mode (default: 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of each mode, interleaved (default: 3)")
    p.add_argument("--storage-dtypes", nargs="+", default=["float32", "bfloat16", "fp8"],
                   help="storage modes for bytes/token (default: float32 bfloat16 fp8)")
    p.add_argument("--no-bf16-capture", action="store_true",
                   help="skip the capture by a bfloat16 copy of the target (cache --dtype bfloat16)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--output-dir", default="runs/bench-cache", help="where the JSON and PNG go")
    args = p.parse_args(argv)
    for name in ("num_conversations", "max_seq_len", "num_target_layers", "repeats", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    return args


def _prepared_rows(args: argparse.Namespace) -> list[dict]:
    if args.prepared:
        rows = [r for r in read_jsonl(args.prepared) if r.get("split") != "heldout"]
        return rows[: args.num_conversations]
    demo = load_sharegpt_demo(args.num_conversations)
    rows = []
    for i, rec in enumerate(demo.rows):
        try:
            messages = normalise_messages(rec, where=f"sharegpt[{i}]")
        except SkipRow:
            continue
        rows.append({"id": f"sharegpt-{i}", "source_index": i, "messages": messages, "truncated": False,
                     "truncated_turns": [], "split": "train"})
    return rows[: args.num_conversations]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_plain(base, ids_list: list[torch.Tensor], device: torch.device) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        for ids_T in ids_list:
            base(input_ids=ids_T.to(device)[None, :], use_cache=False)
    _sync(device)
    return time.perf_counter() - t0


def _time_plain_batched(base, ids_list: list[torch.Tensor], batch_size: int, device: torch.device) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        for b0 in range(0, len(ids_list), batch_size):
            batch = ids_list[b0:b0 + batch_size]
            width = max(len(t) for t in batch)
            ids_BS = torch.zeros(len(batch), width, dtype=torch.long)
            mask_BS = torch.zeros(len(batch), width, dtype=torch.long)
            for b, ids_T in enumerate(batch):
                ids_BS[b, : len(ids_T)] = ids_T
                mask_BS[b, : len(ids_T)] = 1
            base(input_ids=ids_BS.to(device), attention_mask=mask_BS.to(device), use_cache=False)
    _sync(device)
    return time.perf_counter() - t0


def _time_capture(model, ids_list: list[torch.Tensor], layer_ids: list[int], device: torch.device) -> float:
    t0 = time.perf_counter()
    for ids_T in ids_list:
        capture_sample_features(model, ids_T, layer_ids)
    _sync(device)
    return time.perf_counter() - t0


def _write(prepared: Path, out_dir: Path, model, tokenizer, *, layer_ids, args, storage_dtype, fingerprints):
    return write_target_cache(
        prepared, out_dir, model, tokenizer, target_layer_ids=layer_ids, max_seq_len=args.max_seq_len,
        storage_dtype=storage_dtype, progress=False, target_fingerprint=fingerprints[0],
        tokenizer_fingerprint=fingerprints[1],
    )


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(result["tok_per_s"])
    ax_t.bar(modes, [result["tok_per_s"][m] for m in modes])
    ax_t.tick_params(axis="x", labelrotation=20)
    ax_t.set_ylabel("tokens/s (median)")
    ax_t.set_title(f"capture overhead {100 * result['capture_overhead_frac']:+.1f} %")
    storage = [s for s in result["bytes_per_token"] if result["bytes_per_token"][s].get("on_disk")]
    ax_b.bar(storage, [result["bytes_per_token"][s]["on_disk"] for s in storage])
    ax_b.set_ylabel("bytes per token (on disk)")
    ax_b.set_title(f"{result['target']}, {result['num_target_layers']} layers")
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tokenizer = load_target(args.target)
    model.to(device)
    base = _base_model(model)
    L = model.config.num_hidden_layers
    layer_ids = validate_target_layer_ids(default_target_layer_ids(L, args.num_target_layers), L)
    hidden = int(model.config.hidden_size)
    fingerprints = (target_fingerprint(model), tokenizer_fingerprint(tokenizer))

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="deepspec-bench-cache-"))
    prepared = work / "prepared.jsonl"
    rows = _prepared_rows(args)
    prepared.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    counts: dict[str, int] = {}
    samples = list(iter_prepared_samples(rows, tokenizer, max_seq_len=args.max_seq_len, counts=counts))
    ids_list = [torch.tensor(ids, dtype=torch.long) for _, ids, _ in samples]
    num_tokens = sum(len(t) for t in ids_list)
    print(f"target {args.target} on {device}, {torch.get_num_threads()} threads; {len(rows)} conversations -> "
          f"{len(samples)} samples, {num_tokens} tokens (max_seq_len {args.max_seq_len}: {counts['num_truncated']} "
          f"truncated, {counts['num_refused_empty_mask']} left without loss tokens); layers {layer_ids}")

    # warm-up (allocator, kernels, lazy imports), then interleaved repetitions
    _time_plain(base, ids_list[:2], device)
    _time_plain_batched(base, ids_list[:2], args.batch_size, device)
    _time_capture(model, ids_list[:2], layer_ids, device)
    cast = {} if args.no_bf16_capture else {"capture-bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    for m in cast.values():
        _time_capture(m, ids_list[:2], layer_ids, device)
    times: dict[str, list[float]] = {"plain": [], "plain-batched": [], "capture": [], **{k: [] for k in cast},
                                     "capture+write": []}
    for rep in range(args.repeats):
        times["plain"].append(_time_plain(base, ids_list, device))
        times["plain-batched"].append(_time_plain_batched(base, ids_list, args.batch_size, device))
        times["capture"].append(_time_capture(model, ids_list, layer_ids, device))
        for mode, m in cast.items():
            times[mode].append(_time_capture(m, ids_list, layer_ids, device))
        t0 = time.perf_counter()
        summary = _write(prepared, work / f"write-{rep}", model, tokenizer, layer_ids=layer_ids, args=args,
                         storage_dtype="float32", fingerprints=fingerprints)
        times["capture+write"].append(time.perf_counter() - t0)
        assert summary.num_tokens == num_tokens, (summary.num_tokens, num_tokens)
        print(f"  rep {rep}: " + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in times))
    median_s = {m: statistics.median(v) for m, v in times.items()}
    tok_per_s = {m: num_tokens / s for m, s in median_s.items()}
    overhead = median_s["capture"] / median_s["plain"] - 1.0
    write_overhead = median_s["capture+write"] / median_s["plain"] - 1.0

    bytes_per_token: dict[str, dict] = {}
    for storage in args.storage_dtypes:
        formula = cache_bytes_per_token(hidden, len(layer_ids), storage)
        s = _write(prepared, work / f"size-{storage}", model, tokenizer, layer_ids=layer_ids, args=args,
                   storage_dtype=storage, fingerprints=fingerprints)
        bytes_per_token[storage] = {"on_disk": s.total_bytes / s.num_tokens, "formula": formula}
    original = cache_bytes_per_token(hidden, len(layer_ids), "bfloat16", layout="original")

    result = {
        "target": args.target,
        "device": str(device),
        "num_threads": torch.get_num_threads(),
        "num_conversations": len(rows),
        "num_samples": len(samples),
        "render_counts": counts,
        "num_tokens": num_tokens,
        "max_seq_len": args.max_seq_len,
        "target_layer_ids": layer_ids,
        "num_target_layers": len(layer_ids),
        "hidden_size": hidden,
        "repeats": args.repeats,
        "batch_size": args.batch_size,
        "times_s": times,
        "median_s": median_s,
        "tok_per_s": tok_per_s,
        "capture_overhead_frac": overhead,
        "capture_plus_write_overhead_frac": write_overhead,
        "capture_overhead_goal_met": overhead <= 0.10,
        "bytes_per_token": bytes_per_token,
        "original_layout_bf16_bytes_per_token": original,
    }
    (out / "cache_bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    _plot(result, out / "cache_bench.png")

    print(f"\n{'mode':<15}{'median s':>10}{'tok/s':>12}{'vs plain':>10}")
    for m in times:
        print(f"{m:<15}{median_s[m]:>10.3f}{tok_per_s[m]:>12.1f}{median_s[m] / median_s['plain']:>10.3f}")
    print(f"capture overhead {100 * overhead:+.1f} % (goal <= 10 %: {'met' if overhead <= 0.10 else 'NOT met'}); "
          f"capture + cache write {100 * write_overhead:+.1f} %")
    print(f"\n{'storage':<10}{'on disk B/tok':>15}{'formula B/tok':>15}")
    for storage, v in bytes_per_token.items():
        print(f"{storage:<10}{v['on_disk']:>15.1f}{v['formula']:>15}")
    print(f"original DeepSpec layout, bf16: {original} B/tok")
    print(f"\nwrote {out / 'cache_bench.json'} and {out / 'cache_bench.png'}")
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
