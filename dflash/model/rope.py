"""Rotary position embedding applied to queries and keys: shared by the drafter's attention and
the target's written-out layers (`dflash.model.decoder`)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x, cos, sin):
    """x: (b, heads, n, d); cos/sin: (b, n, d)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
