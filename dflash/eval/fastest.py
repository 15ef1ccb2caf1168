"""Which decoding method to serve: the fastest at batch 1 over the target alone, overall and per
eval set, from the acceptance stage's own clock (every method decodes the same prompts there,
so the speedups compare; DDTree decodes a subset and is left to its own line of the summary).

The methods differ in who can serve them: the chain is what vLLM's and SGLang's DFlash methods
run; prompt lookup is nearest to vLLM's `ngram` method; the drafter + lookup branch is this
evaluation's own decoder, which neither engine serves. So where the branch or lookup wins, the
summary says what the chain gives up beside it.
"""

from __future__ import annotations

LABELS = {"drafter": "the chain", "drafter+lookup": "the drafter + lookup branch",
          "lookup": "prompt lookup"}  # fmt: skip
SERVED_BY = {"drafter": "vLLM's and SGLang's DFlash methods",
             "lookup": "nearest to vLLM's `ngram` method",
             "drafter+lookup": "this evaluation's own decoder; neither engine serves it"}  # fmt: skip


def speedups(acceptance: dict) -> tuple[dict, dict[str, dict]]:
    """(method -> speedup over all prompts, set -> method -> speedup on that set's prompts), for
    the chain and the baselines the evaluation ran beside it (the target alone's clock as base)."""
    base = acceptance.get("baselines", {})
    overall = {"drafter": acceptance["speedup"]}
    overall |= {k: base[k]["speedup"] for k in LABELS if k in base and k != "drafter"}
    per_set = {}
    sets = acceptance.get("baseline_sets", {})
    target = sets.get("target", {})
    for name, m in acceptance["sets"].items():
        alone = target.get(name, {}).get("tokens_per_s")
        if not alone:
            continue
        rates = {"drafter": m["tokens_per_s"]}
        rates |= {k: sets[k][name]["tokens_per_s"] for k in overall if name in sets.get(k, {})}
        per_set[name] = {k: rate / alone for k, rate in rates.items()}
    return overall, per_set


def _best(by_method: dict) -> str:
    return max(by_method, key=by_method.get)


def fastest_text(acceptance: dict) -> str | None:
    """The summary's paragraph on what to serve; None where the evaluation ran no baseline to
    set beside the chain."""
    overall, per_set = speedups(acceptance)
    if len(overall) < 2:
        return None
    best = _best(overall)
    others = ", ".join(f"{LABELS[k]} {v:.2f}x" for k, v in overall.items() if k != best)
    text = (
        f"**Fastest at batch 1** (new tokens/s over the target alone, the same prompts, this "
        f"evaluation's clock): {LABELS[best]}, {overall[best]:.2f}x over all prompts ({others}); "
        f"it is {SERVED_BY[best]}."
    )
    if len(per_set) > 1:
        cells = []
        for name, by_method in per_set.items():
            top = _best(by_method)
            cell = f"{name} {LABELS[top]} {by_method[top]:.2f}x"
            if top != "drafter":
                cell += f" (the chain {by_method['drafter']:.2f}x)"
            cells.append(cell)
        text += " Per set: " + "; ".join(cells) + "."
    return text
