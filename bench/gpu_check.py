"""The prepared GPU check: every GPU figure DeepSpec reports, in one call under one deadline.

Run from the repository root on a machine with CUDA (for example through a lent device, whose
``$OUT`` folder comes back)::

    python3 bench/gpu_check.py --deadline 480 --out "$OUT"

Parts, in this order; each runs in its own process with a timeout cut to what is left of the global
``--deadline`` (seconds from the driver's start), and ``summary.json`` is rewritten after every part, so
a run stopped from outside still leaves every finished part's figures:

1. ``preflight`` (about 30 s): versions, the optional packages missing, whether the installed
   transformers' ``StaticLayer`` has ``crop`` (the compiled path does not need it), a measured bf16
   matrix-product rate, a tiny compiled flex_attention forward and backward under bf16 autocast (the
   dtype it ran in), and a 2-layer compiled target prepared and decoded against the eager engine
   (outputs equal, CUDA-graph skips counted), then with a DSpark draft proposing through its compiled
   graphs beside the eager proposer (the same steps; both proposals timed).
2. ``train``: ``bench/train.py --qwen3-4b`` (the qwen3-4b recipe's DSpark step on a Qwen3-4B-shaped
   target: step time, MFU), with the dense-mask step beside flex and one profiled step (top CUDA kernels).
3. ``tests_flex``: ``pytest tests/gpu -k flex`` (flex against the dense mask, with the dtypes flex ran in).
4. ``decode``: ``bench/decode.py --qwen3-4b --layers N --compile on`` on synthetic prompts in one static
   cache bucket (compiled target-only against ``generate()``, a block-8 speculative step against a
   one-token step), then one speculative generation profiled (top operators and kernels).
5. ``tests``: the rest of ``tests/gpu`` with the time left.

A part whose Python packages are missing (pytest, matplotlib, ...) is skipped with one line. Writes
under ``--out``: ``summary.json``, ``log.txt`` (every part's output), and the benches' JSON and PNG files
(at most 8 files, one folder: what a device tool brings back). Exit status 0 when every part that ran
passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("pytest", "tensorboard", "matplotlib", "safetensors", "tokenizers", "tqdm", "datasets", "openai", "gguf")
# part -> (longest it may take, s; packages it needs)
PARTS = {
    "preflight": (60, ()),
    "train": (170, ("matplotlib",)),
    "tests_flex": (90, ("pytest",)),
    "decode": (170, ("matplotlib", "tqdm")),
    "tests": (600, ("pytest",)),
}
MIN_PART_S = 20  # a part with less time left than this is skipped


def missing_packages(names=OPTIONAL) -> list[str]:
    """The names among ``names`` that cannot be imported here."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def part_commands(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    """The command line of each part (run from the repository root)."""
    py = sys.executable
    return {
        "preflight": [py, str(Path(__file__).resolve()), "--preflight-only", "--out", str(out)],
        "train": [py, "bench/train.py", "--qwen3-4b", "--repeats", str(args.train_repeats), "--qwen3-dense",
                  "--profile", "--output-dir", str(out)],
        "tests_flex": [py, "-m", "pytest", "-q", "-s", "-m", "gpu", "tests/gpu", "-k", "flex", "-p", "no:cacheprovider"],
        "decode": [py, "bench/decode.py", "--qwen3-4b", "--layers", str(args.decode_layers), "--draft", "untrained",
                   "--compile", "on", "--temperatures", "0", "--baselines", "none", "--synthetic-prompts",
                   str(args.decode_prompts), "--max-new-tokens", str(args.decode_max_new_tokens), "--repeats", "2",
                   "--profile", "--output-dir", str(out)],
        "tests": [py, "-m", "pytest", "-q", "-s", "-m", "gpu", "tests/gpu", "-k", "not flex", "-p", "no:cacheprovider"],
    }


def run_part(cmd: list[str], timeout_s: float, log) -> tuple[int, float, str]:
    """Run ``cmd`` in its own process group, its output appended to ``log`` and echoed; kill the whole
    group at ``timeout_s``. Returns (exit status, 124 on timeout; wall seconds; the output's last 4,000
    characters)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: list[str] = []
    deadline = t0 + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    rc = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            break
        if sel.select(timeout=min(left, 1.0)):
            line = proc.stdout.readline()
            if line == "":
                rc = proc.wait()
                break
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            tail.append(line)
            del tail[:-200]
        elif proc.poll() is not None:
            rest = proc.stdout.read()
            log.write(rest)
            tail.append(rest)
            rc = proc.returncode
            break
    return rc, time.monotonic() - t0, "".join(tail)[-4000:]


def figures_of(part: str, out: Path) -> dict:
    """The headline figures a part wrote (read from its JSON), for summary.json."""
    try:
        if part == "preflight":
            return json.loads((out / "preflight.json").read_text())
        if part == "train":
            r = json.loads((out / "train_bench_qwen3_4b.json").read_text())
            return {"device_name": r.get("device_name"), "modes": {
                m: {k: v.get(k) for k in ("median_step_s", "mfu", "achieved_tflops", "peak_memory_gib", "error")}
                for m, v in r["chunked_head_loss"].items()}, "profile_top_kernels": (r.get("profile_top_kernels") or [])[:8]}
        if part == "decode":
            r = json.loads((out / "decode_bench.json").read_text())
            return {"goals": r.get("goals"), "settings": {
                name: {m: {k: f.get(k) for k in ("tok_per_s", "speedup", "tau", "step_ms", "propose_ms", "verify_ms",
                                                  "overhead_ms")} for m, f in s["methods"].items()}
                for name, s in r["settings"].items()}}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"figures_error": f"{type(exc).__name__}: {exc}"}
    return {}


def preflight(out: Path) -> dict:
    """Part 1, in this process: versions, a matmul rate, compiled flex fwd+bwd dtypes, a 2-layer compiled
    target against the eager engine. Writes ``preflight.json`` and returns it; raises on a failed check."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    r: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0],
               "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
               "missing_packages": missing_packages()}
    if not torch.cuda.is_available():
        raise SystemExit("preflight: CUDA is not available here; run this check on a machine with a GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    r |= {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30, "sm_count": props.multi_processor_count,
          "bf16": torch.cuda.is_bf16_supported()}
    from transformers import cache_utils

    r["transformers_static_layer_has_crop"] = hasattr(getattr(cache_utils, "StaticLayer", None), "crop")
    # measured bf16 dense matmul rate (the MFU ceiling beside the datasheet's)
    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    r["bf16_matmul_tflops"] = 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12
    del a, b
    r["flex"] = _preflight_flex(dev)
    r["compiled_target"] = _preflight_compiled(dev)
    (out / "preflight.json").write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps(r, indent=2))
    return r


def _preflight_flex(dev) -> dict:
    """A compiled flex_block_attention forward and backward under bf16 autocast, q/k float32 and v
    bf16 as the draft's q/k norms leave them: the dtype it ran in must be bf16."""
    import torch

    from deepspec.algorithms.dspark.model import flex_block_attention
    from deepspec.models.mask import flex_block_mask

    t0 = time.perf_counter()
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, S, A, K, d = 1, 4, 256, 16, 4, 64
    anchors = torch.sort(torch.randperm(S - K, device=dev, generator=g)[:A]).values[None]
    valid = torch.ones(1, A, dtype=torch.bool, device=dev)
    mask = flex_block_mask(anchors, valid, S, K, device=dev, pad_to_blocks=True)
    q = torch.randn(B, H, A * K, d, device=dev, generator=g, requires_grad=True)
    k = torch.randn(B, H, S + A * K, d, device=dev, generator=g, requires_grad=True)
    v = torch.randn(B, H, S + A * K, d, device=dev, generator=g).bfloat16().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = flex_block_attention(q, k, v, mask, enable_gqa=False)
    o.float().square().mean().backward()
    torch.cuda.synchronize()
    res = {"q_k_v_in": ["float32", "float32", "bfloat16"], "out_dtype": str(o.dtype).removeprefix("torch."),
           "grads_finite": bool(all(torch.isfinite(t.grad).all() for t in (q, k, v))),
           "seconds_with_compile": time.perf_counter() - t0}
    if o.dtype != torch.bfloat16 or not res["grads_finite"]:
        raise AssertionError(f"preflight flex: {res}")
    return res


def _preflight_compiled(dev) -> dict:
    """A 2-layer random Qwen3 on the compiled path (static cache, CUDA graphs), prepared for steps of 1
    and 8 tokens, decoding 24 tokens greedily in float32: equal to the eager engine, no CUDA-graph skip;
    then an untrained DSpark draft (block 7) proposing through its compiled graphs beside the eager
    proposer: the same output and steps, and the two proposals' mean times."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.algorithms.dspark.compiled import compile_proposer
    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.decoding.compiled import CompiledTarget
    from deepspec.decoding.engine import SpeculativeEngine

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(cfg).to(dev).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # no near-ties
    counters.clear()
    t0 = time.perf_counter()
    compiled = CompiledTarget(model, (1, 8))
    compiled.prepare([0], 64, [1, 8])
    prepare_s = time.perf_counter() - t0
    prompt = [5, 17, 99, 3, 250, 41, 7]
    eager = SpeculativeEngine(model, [0], NullProposer(), [1]).generate(prompt, max_new_tokens=24)
    fast = SpeculativeEngine(model, [0], NullProposer(), [1], compiled=compiled).generate(prompt, max_new_tokens=24)
    skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    res = {"prepare_s": prepare_s, "identical_to_eager": fast.output_ids == eager.output_ids,
           "num_new_tokens": len(fast.output_ids), "cudagraph_skips": skips,
           "step_ms_eager": 1e3 * sum(s.time_s for s in eager.steps[1:]) / max(len(eager.steps) - 1, 1),
           "step_ms_compiled": 1e3 * sum(s.time_s for s in fast.steps[1:]) / max(len(fast.steps) - 1, 1)}
    if not res["identical_to_eager"] or skips:
        raise AssertionError(f"preflight compiled target: {res}")
    dcfg = draft_config_from_target(model.config, num_draft_layers=1, target_layer_ids=[0], mask_token_id=4095,
                                    block_size=7, markov_rank=16)
    draft = DSparkDraftModel.from_target(model, dcfg).to(dev).eval()
    eager = SpeculativeEngine(model, [0], DSparkProposer(draft), [1], compiled=compiled).generate(prompt, max_new_tokens=24)
    engine = SpeculativeEngine(model, [0], compile_proposer(DSparkProposer(draft)), [1], compiled=compiled)
    t0 = time.perf_counter()
    engine.generate(prompt, max_new_tokens=4)  # compiles the draft's graphs (untimed in the engine)
    res["draft_prepare_s"] = time.perf_counter() - t0
    fast = engine.generate(prompt, max_new_tokens=24)
    skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    res |= {"draft_identical_to_eager": fast.output_ids == eager.output_ids
            and [x.num_accepted for x in fast.steps] == [x.num_accepted for x in eager.steps],
            "cudagraph_skips_with_draft": skips,
            "propose_ms_eager": 1e3 * sum(x.propose_s for x in eager.steps) / max(len(eager.steps), 1),
            "propose_ms_compiled": 1e3 * sum(x.propose_s for x in fast.steps) / max(len(fast.steps), 1)}
    if not res["draft_identical_to_eager"] or skips:
        raise AssertionError(f"preflight compiled draft: {res}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deadline", type=float, default=480.0, help="seconds from start for all parts together")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check", help="output folder (default: $OUT)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--decode-layers", type=int, default=8, help="decoder layers of the decode part's Qwen3-4B-shaped target")
    p.add_argument("--decode-prompts", type=int, default=2)
    p.add_argument("--decode-max-new-tokens", type=int, default=96)
    p.add_argument("--preflight-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.preflight_only:
        preflight(out)
        return 0
    parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}; expected a subset of {', '.join(PARTS)}")
    t_start = time.monotonic()
    commands = part_commands(args, out)
    missing = set(missing_packages())
    summary: dict = {"deadline_s": args.deadline, "parts": {}}
    status = 0
    with open(out / "log.txt", "a", encoding="utf-8") as log:
        for part in parts:
            budget, needs = PARTS[part]
            left = args.deadline - (time.monotonic() - t_start)
            lacking = sorted(set(needs) & missing)
            entry: dict
            if lacking:
                entry = {"status": "skipped", "why": f"missing packages: {', '.join(lacking)}"}
            elif left < MIN_PART_S:
                entry = {"status": "skipped", "why": f"{left:.0f} s left of the {args.deadline:.0f} s deadline"}
            else:
                timeout = min(budget, left)
                header = f"\n===== {part} (timeout {timeout:.0f} s): {' '.join(commands[part])}\n"
                log.write(header)
                print(header, end="", flush=True)
                rc, wall, tail = run_part(commands[part], timeout, log)
                entry = {"status": "passed" if rc == 0 else ("timed out" if rc == 124 else "failed"), "rc": rc,
                         "wall_s": round(wall, 1), **figures_of(part, out)}
                if rc != 0:
                    entry["tail"] = tail[-1500:]
                    status = 1
            summary["parts"][part] = entry
            summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
            (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
            print(f"----- {part}: {entry['status']}" + (f" ({entry.get('why')})" if "why" in entry else ""), flush=True)
    print("\nsummary: " + ", ".join(f"{k} {v['status']}" for k, v in summary["parts"].items())
          + f"; {summary['elapsed_s']:.0f} s of {args.deadline:.0f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
