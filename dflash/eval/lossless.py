"""Is speculative decoding's output the target's own greedy output?

In float32 the answer is a plain comparison: a verify forward of B tokens and a one-token step
round alike, so any difference is a bug. In bf16 (how a serving engine runs) they do not: the
two shapes take different kernels, and where the target's top two logits are nearly tied the
argmax can flip, after which the two continuations part for good. Such a divergence says
nothing about the drafter. So each generation that differs from the reference is judged at its
first differing token: the target's logits there (one forward of the shared prefix) give the gap
between the token the reference chose and the one the speculative loop chose. Within
`eval.tie_margin` it is a near tie (reported, not an error); beyond it, the loop committed a
token the target clearly did not pick, which is a bug whatever the dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Divergence:
    prompt: str  # the eval prompt's id
    position: int  # index of the first differing generated token
    reference: int | None  # the target-only token there (None: the reference had stopped)
    speculative: int | None
    gap: float | None  # logit(reference) - logit(speculative) at that position


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (one ending early counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def logit_gap(model, context: list[int], chosen: int, other: int) -> float:
    """logit(chosen) - logit(other) for the token after `context`, one plain forward."""
    device = model.get_input_embeddings().weight.device
    logits = model(input_ids=torch.tensor([context], device=device)).logits[0, -1].float()
    return float(logits[chosen] - logits[other])


def divergence(model, prompt_id: str, prompt: list[int], ref: list[int], got: list[int]):
    """The first difference between a reference generation and a speculative one, with the
    target's logit gap there (None when they are equal)."""
    p = first_difference(ref, got)
    if p is None:
        return None
    r = ref[p] if p < len(ref) else None
    s = got[p] if p < len(got) else None
    gap = None if r is None or s is None else logit_gap(model, prompt + ref[:p], r, s)
    return Divergence(prompt_id, p, r, s, None if gap is None else round(gap, 4))


def judge(divergences: list[Divergence], exact: bool, margin: float) -> tuple[list, list]:
    """(near ties, real mismatches) as dicts. `exact` (float32): every divergence is real."""
    ties, real = [], []
    for d in divergences:
        near = not exact and d.gap is not None and abs(d.gap) <= margin
        (ties if near else real).append(asdict(d))
    return ties, real
