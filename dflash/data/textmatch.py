"""One text found inside another, whitespace aside: how a held-out prompt is kept out of the
training rows (`expand`) and how every eval prompt is looked for in them (dflash/eval/overlap.py).

A text is found when it equals a user turn, or when its middle PROBE_CHARS characters occur
inside one: the middle sees through words a format wraps around a problem (HumanEval's
"Complete the following Python function:") and through a reposted prompt with another opening,
while a shared template's opening (CodeI/O's "Write a Python function `main_solution`...") does
not make two different problems one. Texts under MIN_CHARS ("continue", "go on") recur in any
chat data and say nothing of the answer: they are not looked for."""

from __future__ import annotations

PROBE_CHARS = 80
MIN_CHARS = 40


def normalized(text: str) -> str:
    return " ".join(text.split())


def probe(text: str) -> str:
    """The middle PROBE_CHARS characters of a normalized text (the whole text when shorter)."""
    middle = max(0, (len(text) - PROBE_CHARS) // 2)
    return text[middle : middle + PROBE_CHARS]


def user_turns(conversation: list[dict]) -> list[str]:
    return [normalized(t["content"]) for t in conversation if t["role"] == "user"]


def searchable(text: str) -> bool:
    return len(text) >= MIN_CHARS
