"""torch's Muon with the matrices of one shape orthogonalised together.

`torch.optim.Muon` walks its matrices one at a time: a chain of about twenty small kernels each
(momentum, the bf16 cast, the norm, five Newton-Schulz iterations of three matmuls, the update).
A drafter's layers repeat a handful of shapes, so at the recipe's shapes that is 36 chains whose
launches, not their arithmetic, set the step's cost (13-20 ms against AdamW's 0.4-0.6 on one
H100, docs/benchmarks/2026-12-07-lever-costs-h100.md). Here each shape's matrices go through
the same arithmetic stacked, with batched matmuls (`baddbmm`) and foreach updates: the same
update as torch's (bit for bit on CPU in the tests, and on one H100 for the recipe's shapes),
the same per-parameter state (`momentum_buffer`), so checkpoints move between the two. On that
H100 the recipe's Muon step fell from 14-22 ms to 3.1 ms; at 8B shapes, where the step is
arithmetic, it is unchanged (183 ms).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim._muon import _adjust_lr  # its lr per matrix shape, not a copy of it


def orthogonalise(stacked: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Newton-Schulz over a stack of same-shaped matrices (n, rows, cols), in bf16, as torch's
    `_zeropower_via_newtonschulz` does for one."""
    a, b, c = coefficients
    x = stacked.bfloat16()
    tall = stacked.shape[-2] > stacked.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


class GroupedMuon(torch.optim.Muon):
    """`torch.optim.Muon`, its matrices of one shape stepped as one stack."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            by_shape = defaultdict(list)
            for i, p in enumerate(params):
                by_shape[(p.shape, p.dtype, p.device)].append(i)
            for (shape, _, _), idx in by_shape.items():
                self._step_shape(group, shape, [params[i] for i in idx],
                                 [grads[i] for i in idx], [bufs[i] for i in idx])  # fmt: skip
        return loss

    @staticmethod
    def _step_shape(group, shape, params, grads, bufs) -> None:
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        if group["nesterov"]:
            updates = torch._foreach_lerp(grads, bufs, momentum)
        else:
            updates = bufs
        ortho = orthogonalise(
            torch.stack(updates), group["ns_coefficients"], group["ns_steps"], group["eps"]
        )
        lr = group["lr"]
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        step = -_adjust_lr(lr, group["adjust_lr_fn"], shape)
        torch._foreach_add_(params, list(ortho.unbind(0)), alpha=step)
