"""fp8 feature storage: reconstruction error on real target features.

Captures the features of real conversations with the cache writer's capture rule, stores them as the
``fp8`` storage mode does (float8 e4m3 with a float32 scale per token and target layer,
:func:`deepspec.data.cache.fp8.quantize_fp8`), reads them back (:func:`deepspec.data.cache.fp8.dequantize_fp8`)
and prints, per target layer, the relative L2 error (against bfloat16 storage for comparison), the
largest absolute error against its bound (token-layer absmax / 28), and the lowest cosine similarity.
Writes ``fp8_error.json`` under ``--output-dir``.

    python bench/fp8_error.py --num-conversations 32 --max-seq-len 512 --output-dir runs/bench-fp8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.data.cache.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from deepspec.data.cache.samples import iter_prepared_samples  # noqa: E402
from deepspec.data.conversations import SkipRow, load_sharegpt_demo, normalise_messages  # noqa: E402
from deepspec.target.capture import capture_sample_features, default_target_layer_ids  # noqa: E402
from deepspec.target.load import load_target  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-conversations", type=int, default=32, help="ShareGPT demo conversations (default: 32)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens kept per sample (default: 512)")
    p.add_argument("--num-target-layers", type=int, default=5, help="feature layers, evenly spaced (default: 5)")
    p.add_argument("--output-dir", default="runs/bench-fp8", help="where fp8_error.json goes")
    args = p.parse_args(argv)

    model, tokenizer = load_target(args.target)
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    layer_ids = default_target_layer_ids(L, args.num_target_layers)
    rows = []
    for i, rec in enumerate(load_sharegpt_demo(4 * args.num_conversations).rows):
        try:
            rows.append({"id": f"sharegpt-{i}", "messages": normalise_messages(rec, where=f"sharegpt[{i}]")})
        except SkipRow:
            continue
        if len(rows) == args.num_conversations:
            break
    feats = [capture_sample_features(model, ids, layer_ids)[0].float()
             for _, ids, _ in iter_prepared_samples(rows, tokenizer, max_seq_len=args.max_seq_len)]
    x = torch.cat(feats)
    y = dequantize_fp8(*quantize_fp8(x, len(layer_ids)))
    bf16 = x.to(torch.bfloat16).float()
    per_layer = []
    print(f"{args.target}: {len(feats)} samples, {x.shape[0]} tokens, layers {layer_ids}")
    print(f"{'layer':>5} {'rel L2 fp8':>11} {'rel L2 bf16':>12} {'max err/bound':>14} {'min cos':>9}")
    for k, layer in enumerate(layer_ids):
        xs, ys, bs = x[:, k * H:(k + 1) * H], y[:, k * H:(k + 1) * H], bf16[:, k * H:(k + 1) * H]
        bound = xs.abs().amax(-1, keepdim=True) / 28  # e4m3: half the widest step (32) at scale absmax/448
        row = {
            "layer": layer,
            "rel_l2_fp8": ((ys - xs).norm() / xs.norm()).item(),
            "rel_l2_bf16": ((bs - xs).norm() / xs.norm()).item(),
            "max_err_over_bound": ((ys - xs).abs() / bound).max().item(),
            "min_cosine": torch.nn.functional.cosine_similarity(xs, ys, dim=-1).min().item(),
        }
        per_layer.append(row)
        print(f"{layer:>5} {row['rel_l2_fp8']:>11.4f} {row['rel_l2_bf16']:>12.5f} "
              f"{row['max_err_over_bound']:>14.3f} {row['min_cosine']:>9.5f}")
    result = {"target": args.target, "num_samples": len(feats), "num_tokens": int(x.shape[0]),
              "target_layer_ids": layer_ids, "per_layer": per_layer}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_error.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out / 'fp8_error.json'}")
    return result


if __name__ == "__main__":
    main()
