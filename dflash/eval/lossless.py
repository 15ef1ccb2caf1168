"""Is speculative decoding's output the target's own greedy output?

In float32 the answer is a plain comparison: a verify forward of B tokens and a one-token step
round alike, so any difference is a bug. In bf16 (how a serving engine runs) they do not: the
two shapes take different kernels, and where the target's top two logits are nearly tied the
argmax can flip, after which the two continuations part for good. Such a divergence says
nothing about the drafter. So each generation that differs from the reference is judged at its
first differing token: the target's logits there (one forward of the shared prefix) give the gap
between the token the reference chose and the one the speculative loop chose. Within
`eval.tie_margin` it is a near tie (reported, not an error). That forward rounds too: 2026-12-05,
on an H100 in bf16, a tree's divergence at a digit 193 tokens into a GSM8K answer measured a
gap of 1.0 and failed the run, while the same prompt and drafter were exact in float32. So a
reduced-precision gap beyond the margin is measured once more by the target in float32
(`recheck_in_float32`) and judged by that gap. Beyond the margin in float32 too, the loop
committed a token the target clearly did not pick, which is a bug whatever the dtype.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class Divergence:
    prompt: str  # the eval prompt's id
    position: int  # index of the first differing generated token
    reference: int | None  # the target-only token there (None: the reference had stopped)
    speculative: int | None
    gap: float | None  # logit(reference) - logit(speculative) at that position
    gap_float32: float | None = None  # the same gap from the target in float32, when rechecked


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


def beyond(d: Divergence, margin: float) -> bool:
    """A gap past the margin in the run's own dtype: one for `recheck_in_float32`."""
    return d.gap is not None and abs(d.gap) > margin


def recheck_in_float32(
    target: Path, checks: list[tuple[Divergence, list[int]]], device: torch.device
) -> None:
    """Each divergence's gap measured again by the target loaded in float32 from its folder
    (`gap_float32`; the context is the prompt and the shared prefix), one forward per distinct
    (context, tokens) however many methods parted there. The copy goes on the run's GPU
    (`device`) when it fits in what is free there, else in host memory: it is needed only for
    the rare gap that the run's own dtype put past the margin."""
    from transformers import AutoModelForCausalLM

    from dflash.model.memory import gpu_memory, host_available, weight_count

    if not checks:
        return
    need = 1.25 * 4 * weight_count(target)  # loaded in host memory first, then moved
    have = host_available()
    if have < need:
        log.warning(
            "%d divergences past the margin not measured again in float32: the target needs "
            "%.1f GB of host memory, %.1f GB available; the run's own gaps judge them",
            len(checks),
            need / 1e9,
            have / 1e9,
        )
        return
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if gpu_memory(device)[0] > need:
            model = model.to(device)
    gaps: dict[tuple, float] = {}
    for d, context in checks:
        key = (tuple(context), d.reference, d.speculative)
        if key not in gaps:
            gaps[key] = round(logit_gap(model, context, d.reference, d.speculative), 4)
        d.gap_float32 = gaps[key]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy's memory back before the stage reports its peak


def judge(divergences: list[Divergence], exact: bool, margin: float) -> tuple[list, list]:
    """(near ties, real mismatches) as dicts. `exact` (float32): every divergence is real.
    Otherwise a divergence is a near tie when its gap is within the margin: the float32 gap
    where it was measured (the truer one), else the run's own."""
    ties, real = [], []
    for d in divergences:
        gap = d.gap_float32 if d.gap_float32 is not None else d.gap
        near = not exact and gap is not None and abs(gap) <= margin
        (ties if near else real).append(asdict(d))
    return ties, real
