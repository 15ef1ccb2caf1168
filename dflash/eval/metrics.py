"""Acceptance metrics from per-round acceptance lengths (drafts accepted + the bonus token).

- `tau_macro`: mean over prompts of each prompt's mean acceptance length;
- `tau_pooled`: all tokens over all verify rounds (target forwards), pooled across prompts;
- `histogram[k]`: rounds that accepted exactly k tokens, k = 1..B;
- `rates[k]`: P(accept >= k | accept >= k-1) for k = 2..B, the per-position conditional rate
  (where it falls off tells you which draft position the drafter loses).
"""

from __future__ import annotations

import hashlib
import json
import statistics


def text_digest(tokens: list[int], stop: set[int]) -> str:
    """A short fingerprint of one output's token ids, a final stop token left out (engines
    differ in whether they return it): two engines decoded the same text where theirs agree
    (eval_vllm sets vLLM's outputs against ours by it)."""
    tokens = list(tokens)
    if tokens and tokens[-1] in stop:
        tokens.pop()
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def acceptance(per_prompt: list[list[int]], block_size: int) -> dict:
    rounds = [a for prompt in per_prompt for a in prompt]
    if not rounds:
        return {"n_prompts": len(per_prompt), "rounds": 0}
    histogram = {k: sum(1 for a in rounds if a == k) for k in range(1, block_size + 1)}
    at_least = {k: sum(1 for a in rounds if a >= k) for k in range(1, block_size + 1)}
    rates = {
        k: round(at_least[k] / at_least[k - 1], 4) if at_least[k - 1] else None
        for k in range(2, block_size + 1)
    }
    return {
        "n_prompts": len(per_prompt),
        "rounds": len(rounds),
        "tau_macro": round(statistics.fmean(statistics.fmean(p) for p in per_prompt if p), 4),
        "tau_pooled": round(sum(rounds) / len(rounds), 4),
        "histogram": histogram,
        "rates": rates,
    }
