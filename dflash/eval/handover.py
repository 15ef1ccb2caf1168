"""What the user got, at the top of results/summary.md: where the drafter is, the command lines
that serve it beside its target (vLLM and SGLang, as README's "Serve your drafter"), and a
warning where τ cannot mean what it seems to: answers the target regenerated as a loop of a
few tokens (a random or broken target), or τ near the block size."""

from __future__ import annotations

import json
import shlex

from dflash.io import read_json

# warn when this share of training rows loops over a few tokens (tokenize's `repetitive_rows`)
LOOP_WARN_SHARE = 0.5
# a τ this close to the block size is too good for a real target: check the answers
TAU_WARN_SHARE = 0.9


def serve_commands(target: str, drafter: str, block_size: int) -> list[str]:
    """vLLM and SGLang command lines for the drafter: B - 1 drafted tokens a round (vLLM counts
    the speculative ones), B verified (SGLang counts the block)."""
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1}
    return [
        f"vllm serve {shlex.quote(target)} --speculative-config"
        f" {shlex.quote(json.dumps(spec, separators=(', ', ': ')))}",
        f"python -m sglang.launch_server --model-path {shlex.quote(target)}"
        " --speculative-algorithm DFLASH"
        f" --speculative-draft-model-path {shlex.quote(drafter)}"
        f" --speculative-num-draft-tokens {block_size}",  # its DFLASH worker loads ours natively
    ]


def degenerate_warning(tokenized: dict | None, tau_macro: float, block_size: int) -> str | None:
    """A warning that the figures mean nothing, or None."""
    reasons = []
    if tokenized:
        looping, rows = tokenized.get("repetitive_rows", 0), tokenized.get("rows_out", 0)
        if rows and looping >= LOOP_WARN_SHARE * rows:
            reasons.append(
                f"{looping} of {rows} training rows loop over a few tokens (the target's"
                " regenerated answers are degenerate: a random, untrained or broken target?)"
            )
    if tau_macro >= TAU_WARN_SHARE * block_size:
        reasons.append(
            f"τ {tau_macro:.1f} of {block_size} is more than a real target's text allows: the"
            " drafter has learnt to repeat what the target repeats"
        )
    if not reasons:
        return None
    return (
        "**Warning: these figures mean nothing.** "
        + "; ".join(reasons)
        + ". Look at `data/regenerated/train.parquet` (or `data/expanded`) before trusting τ."
    )


def handover_text(
    target: str, drafter: str, block_size: int, tau_macro: float, tokenized: dict | None
) -> list[str]:
    """The summary's opening lines."""
    lines = [
        f"**Your drafter:** `{drafter}` (config, weights and modeling file, in the layout DFlash"
        f" loaders read), for the target `{target}`. Serve it ({block_size}-token blocks; more in"
        " docs/serving.md):",
        "",
        "```bash",
        *serve_commands(target, drafter, block_size),
        "```",
    ]
    warning = degenerate_warning(tokenized, tau_macro, block_size)
    return [warning, "", *lines] if warning else lines


def handover(args, acceptance: dict) -> list[str]:
    """`handover_text` for the report stage's arguments (none without --drafter)."""
    if not getattr(args, "drafter", None):
        return []
    tokenized = read_json(args.tokenized) if getattr(args, "tokenized", None) else None
    return handover_text(
        args.serve_target or "TARGET",
        args.drafter,
        acceptance["block_size"],
        acceptance["tau_macro"],
        tokenized,
    )
