"""Median over prompts of the per-prompt speedup (target-only seconds per token / the method's), per benchmark."""
import json, statistics, sys
r = json.load(open(sys.argv[1]))
for b, methods in r["samples"].items():
    base = methods["target-only"]
    cells = []
    for m, recs in methods.items():
        if m in ("target-only", "hf-generate"):
            continue
        sp = [(t["total_time_s"] / t["num_new_tokens"]) / (x["total_time_s"] / x["num_new_tokens"]) for t, x in zip(base, recs)]
        cells.append(f"{m} {statistics.median(sp):.2f}")
    print(b, "|", ", ".join(cells))
