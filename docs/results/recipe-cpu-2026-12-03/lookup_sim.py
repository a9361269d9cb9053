"""Simulated greedy tau of lookup rules (no draft) on the target's own answers, held out from the corpus.

Usage: .venv/bin/python docs/results/recipe-cpu-2026-12-03/lookup_sim.py PREPARED.jsonl RULE [RULE ..]

A fifth of the prepared rows (seeded shuffle) is held out; the corpus (``NGramCorpus``) is built from the
rest. Each held-out answer is replayed greedily: at every step the rule proposes up to K = 7 tokens from
(prompt + answer so far), the step accepts the proposal's longest prefix equal to the answer's next tokens
and commits one more, as a greedy verify would. tau = answer tokens / steps. A step with no proposal commits
one token (where a draft would propose behind the lookup). Rules:
  ctx{n}          prompt lookup only, matches of 3..n tokens (DeepSpec's ngram baseline with ngram_min n)
  first{n}c{c}    the context first (3..n tokens), else the corpus walk (4..c tokens): DeepSpec's rule
  margin{m}n{n}c{c}  as first{n}c{c}, but the corpus also wins when its match is >= m tokens longer
"""
import json
import random
import sys
from pathlib import Path

from transformers import AutoTokenizer

from deepspec.algorithms.ngram.corpus import NGramCorpus
from deepspec.algorithms.ngram.proposer import ngram_proposal
from deepspec.data.chat import render_prompt
from deepspec.target.load import ensure_embedded_target

K = 7


def context_match(context, n_min):
    """(length of the longest context match of 3..n_min tokens, its proposal)."""
    for n in range(3, n_min - 1, -1):
        ids = ngram_proposal(context, ngram_max=n, ngram_min=n, num_tokens=K)
        if ids:
            return n, ids
    return 0, []


def corpus_match(corpus, context, c_min):
    """The longest context suffix of 4..c_min tokens the corpus holds (0: none)."""
    for n in range(min(corpus.ngram_max, len(context)), c_min - 1, -1):
        if corpus.follower(context[len(context) - n:]) is not None:
            return n
    return 0


def propose(rule, corpus, context):
    if rule.startswith("ctx"):
        return context_match(context, int(rule[3:]))[1]
    if rule.startswith("first"):
        n, c = map(int, rule[5:].split("c"))
        return context_match(context, n)[1] or corpus.continuation(context, max_len=K, ngram_min=c)
    if rule.startswith("margin"):
        m, rest = rule[6:].split("n")
        n, c = map(int, rest.split("c"))
        n_ctx, ids = context_match(context, n)
        n_cor = corpus_match(corpus, context, c)
        if n_cor and (not ids or n_cor >= n_ctx + int(m)):
            return corpus.continuation(context, max_len=K, ngram_min=c)
        return ids
    raise SystemExit(f"unknown rule {rule!r}")


def main(path, rules):
    rows = [r for r in map(json.loads, Path(path).open()) if r.get("generated_ids")]
    random.Random(0).shuffle(rows)
    held, kept = rows[:len(rows) // 5], rows[len(rows) // 5:]
    corpus = NGramCorpus([t for r in kept for t in r["generated_ids"] if t])
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_target())
    totals = {rule: [0, 0] for rule in rules}  # steps, tokens
    for row in held:
        for i, answer in enumerate(row["generated_ids"]):
            if not answer:
                continue
            prompt = render_prompt(tokenizer, row["messages"][:i])
            for rule in rules:
                pos = steps = 0
                while pos < len(answer):
                    proposal = propose(rule, corpus, prompt + answer[:pos])
                    accepted = 0
                    while (accepted < len(proposal) and pos + accepted < len(answer)
                           and proposal[accepted] == answer[pos + accepted]):
                        accepted += 1
                    pos, steps = pos + accepted + 1, steps + 1
                totals[rule][0] += steps
                totals[rule][1] += len(answer)
    result = {"prepared": str(path), "held_out_rows": len(held), "corpus_tokens": corpus.num_tokens,
              "tau": {rule: round(tokens / steps, 3) for rule, (steps, tokens) in totals.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
