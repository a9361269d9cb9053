"""Training-recipe study: held-out greedy tau per step and per CPU-minute for several settings.

Every setting trains a draft on the same target cache with the trainer's learning curve on
(``--heldout-every``; :mod:`deepspec.train.heldout`: the draft's greedy tau on a fixed set of
benchmark prompts, replayed against the target's own greedy outputs), one setting after the other in
this process, so the figures are comparable. A setting is a name and ``TrainConfig`` overrides::

    python bench/recipe.py --cache-dir runs/demo/cache --output-dir runs/recipe-study --max-steps 300 \\
        --setting base: --setting lr1e-2:lr=1e-2 --setting init:init_from_target=true

Printed: per setting, held-out tau at every curve point with the training minutes so far, and the
final tau per benchmark. Written atomically under ``--output-dir``: ``recipe_study.json`` (settings,
curves, step times) and ``recipe_study.png`` (held-out tau against steps and against minutes).
The held-out reference (target greedy outputs + features) is made once and copied to every setting.
With ``--heldout-every 0`` there is no curve: the study prices each setting's training step (median step
time and wall time, printed and in the JSON)::

    python bench/recipe.py --cache-dir runs/recipe/cache --output-dir runs/step-costs --max-steps 80 \
        --heldout-every 0 --setting k3:block_size=3,num_anchors=64 --setting k7:block_size=7,num_anchors=32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.target.load import load_target  # noqa: E402
from deepspec.train.heldout import REFERENCE_NAME, heldout_prompt_ids  # noqa: E402
from deepspec.train.config import TrainConfig  # noqa: E402
from deepspec.train.loop import train  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_setting(text: str) -> tuple[str, dict]:
    """``name:key=value,key=value`` -> (name, overrides); values are JSON where they parse, else strings."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise ValueError(f"--setting {text!r}: expected NAME:key=value,... (NAME: for the defaults)")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in FIELDS:
            raise ValueError(f"--setting {text!r}: {key!r} is not a TrainConfig field")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    fig, (ax_s, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        steps = [p["step"] for p in r["curve"]]
        minutes = [p["elapsed_s"] / 60 for p in r["curve"]]
        taus = [p["heldout_tau"] for p in r["curve"]]
        ax_s.plot(steps, taus, "o-", label=name)
        ax_m.plot(minutes, taus, "o-", label=name)
    ax_s.set_xlabel("training step")
    ax_m.set_xlabel("training minutes (held-out evaluation excluded)")
    for ax in (ax_s, ax_m):
        ax.set_ylabel("held-out greedy tau (accepted + 1 per step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("held-out greedy tau of each training setting (same cache, same prompts)")
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", required=True, help="a target cache (deepspec cache) of the embedded target")
    p.add_argument("--output-dir", required=True, help="one run folder per setting, and the study's JSON/PNG")
    p.add_argument("--setting", action="append", required=True, help="NAME:key=value,... (TrainConfig fields)")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--heldout-every", type=int, default=50)
    p.add_argument("--heldout-benchmarks", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    p.add_argument("--heldout-num-prompts", type=int, default=4)
    p.add_argument("--heldout-max-new-tokens", type=int, default=64)
    p.add_argument("--target", default="default")
    args = p.parse_args(argv)
    settings = [parse_setting(s) for s in args.setting]
    if len({n for n, _ in settings}) != len(settings):
        p.error("--setting names must differ")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target)
    prompts = heldout_prompt_ids(args.heldout_benchmarks, args.heldout_num_prompts, tokenizer)
    reference = None
    results = {}
    for name, overrides in settings:
        run = out / name
        run.mkdir(exist_ok=True)
        if reference is not None and not (run / REFERENCE_NAME).exists():
            shutil.copy(reference, run / REFERENCE_NAME)
        # resume="never": a rerun of the study retrains each setting from step 0 (replacing its earlier run)
        base = dict(cache_dir=args.cache_dir, output_dir=str(run), max_steps=args.max_steps, resume="never",
                    heldout_every=args.heldout_every, heldout_benchmarks=args.heldout_benchmarks,
                    heldout_num_prompts=args.heldout_num_prompts,
                    heldout_max_new_tokens=args.heldout_max_new_tokens)
        cfg = TrainConfig(**{**base, **overrides})
        t0 = time.perf_counter()
        train(cfg, target_model=model, tokenizer=tokenizer, heldout_prompts=prompts)
        wall = time.perf_counter() - t0
        if reference is None and (run / REFERENCE_NAME).exists():  # none with --heldout-every 0
            reference = run / REFERENCE_NAME
        rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        curve = [{k: v for k, v in r.items() if k in ("step", "elapsed_s") or k.startswith("heldout_tau")}
                 for r in rows if "heldout_tau" in r]
        step_times = [r["step_time_s"] for r in rows if "step_time_s" in r]
        results[name] = {"overrides": overrides, "curve": curve, "wall_s": wall,
                         "median_step_s": sorted(step_times)[len(step_times) // 2] if step_times else None}
        if curve:  # --heldout-every 0: step times only
            print(f"{name}: " + ", ".join(f"step {c['step']} ({c['elapsed_s'] / 60:.1f} min) tau {c['heldout_tau']:.2f}"
                                          for c in curve), flush=True)
            print(f"{name}: final " + ", ".join(f"{k[len('heldout_tau_'):]} {v:.2f}" for k, v in curve[-1].items()
                                                if k.startswith("heldout_tau_")), flush=True)
        else:
            print(f"{name}: median step {results[name]['median_step_s']:.3f} s, {wall:.0f} s in all", flush=True)
        atomic_write_json(out / "recipe_study.json", {"args": vars(args), "results": results})
        plot(results, out / "recipe_study.png")
    return results


if __name__ == "__main__":
    main()
