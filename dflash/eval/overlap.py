"""Evaluation prompts found in the training data. A drafter trained on an eval prompt (and on
the target's answer to it) reports a τ it learnt by heart; `expand` keeps the held-out rows'
prompts out of training, and this checks every eval set, a user's own included, with the same
rule (dflash/data/textmatch.py): each user turn a prompt asks (MT-Bench's second turn too) is
found when it equals a training user turn or its middle 80 characters occur inside one."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from dflash.data.textmatch import PROBE_CHARS, normalized, probe, searchable, user_turns
from dflash.eval.sets import EvalPrompt


def training_turns(path: Path) -> list[str]:
    """Every user turn of the training rows (expand's train split), whitespace-collapsed."""
    conversations = pl.read_parquet(path, columns=["conversations"])["conversations"]
    return [t for c in conversations.to_list() for t in user_turns(c)]


def found_in_training(prompts: list[EvalPrompt], train: Path) -> dict:
    """Per eval set: its prompts, each turn counted as the evaluation counts it (MT-Bench's
    second turn is `81#turn2`), and the ids of those found in the training rows."""
    turns = training_turns(train)
    whole = set(turns)
    text = "\n".join(turns)
    by_set: dict[str, dict] = {}
    for prompt in prompts:
        entry = by_set.setdefault(prompt.set_name, {"prompts": 0, "found": []})
        first = sum(m["role"] == "user" for m in prompt.messages)  # the turn the prompt asks
        asked = [prompt.messages[-1]["content"], *prompt.followups]
        for turn, question in enumerate(map(normalized, asked), start=first):
            entry["prompts"] += 1
            if searchable(question) and (question in whole or probe(question) in text):
                entry["found"].append(prompt.id if turn == first else f"{prompt.id}#turn{turn}")
    return by_set


def overlap_text(by_set: dict | None) -> str | None:
    """The summary's sentence: none found, or each set with its prompts found."""
    if not by_set:
        return None
    total = sum(s["prompts"] for s in by_set.values())
    hit = {name: s for name, s in by_set.items() if s["found"]}
    if not hit:
        return (
            f"**Eval prompts in the training data:** none of the {total} prompts (the middle "
            f"{PROBE_CHARS} characters of each turn searched in every training user turn)."
        )
    return (
        "**Eval prompts in the training data:** "
        + "; ".join(
            f"{name}: {len(s['found'])} of {s['prompts']} ({', '.join(s['found'][:5])}"
            f"{', ...' if len(s['found']) > 5 else ''})"
            for name, s in hit.items()
        )
        + " found in the training rows: not held out, their τ may be learnt by heart."
    )
