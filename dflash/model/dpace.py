"""D-PACE: the block slots' loss weights from the drafter's own confidence (`drafter.loss: dpace`).

Where the definition comes from: Wu et al., "D-PACE: Dynamic Position-Aware Cross-Entropy for
Parallel Speculative Drafting" (arXiv:2605.18810), Eq. 7-9, as its authors' SpecForge fork
(github.com/Lucas-TY/D-PACE, `specforge/core/dflash.py`), NVIDIA Model-Optimizer
(`modelopt/torch/speculative/plugins/hf_dflash.py`, `_dpace_position_weights`, PR #1724) and
vllm-project/speculators (`models/metrics.py`, `dpace_loss_decay`, PR #736) compute it. Written
here from that definition; for slots k = 1..B-1 of a block (slot 0, the anchor, is given):

- q_k = exp(-CE_k), the drafter's probability of the label at slot k (no gradient);
- q~_k = (1 - alpha) q_k + alpha (Eq. 7), and 1 at a slot that is not trained (past the row, off
  the loss mask), which then changes no product;
- C_m = prod_{k <= m} q~_k, the smoothed chance that slots 1..m are all accepted;
- w_k = sum_{m >= k, m trained} C_m (Eq. 8), zero where slot k is not trained;
- the loss is sum_k w_k CE_k with w detached (Eq. 9).

With alpha = 0, sum_m C_m is the expected number of accepted draft tokens and the loss's gradient
is exactly minus that sum's gradient (the test checks this); with alpha = 1 every C_m is 1 and
w_k counts the trained slots from k on. The weights follow what limits acceptance as the drafter
learns, where the DFlash paper's exp(-(k-1)/gamma) is fixed.

Normalisation is where the implementations part. `blocks` (the default here) divides by the
number of real blocks (sampled anchors), which keeps the weights' mass, what the paper's author
asked SpecForge for (sgl-project/SpecForge issue 828; the authors' own code divides by the batch
size). `weights` divides by the sum of the weights, as Model-Optimizer does: a weighted mean
whose scale does not grow as the drafter gets surer. speculators divides by the number of trained
slots, which is `blocks` times a near-constant for long answers.
"""

from __future__ import annotations

import torch

NORMS = ("blocks", "weights")


def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """(..., B) detached D-PACE weights from the per-slot CE (..., B) and the trained slots
    (..., B) bool (slot 0 is never trained). Computed in fp32."""
    with torch.no_grad():
        smoothed = (1.0 - alpha) * torch.exp(-ce.float()) + alpha
        smoothed = torch.where(trained, smoothed, torch.ones_like(smoothed))
        reach = torch.cumprod(smoothed, dim=-1) * trained  # C_m at trained slots, else 0
        # suffix sums: the total minus the sums before each slot
        before = torch.cumsum(reach, dim=-1) - reach
        return (reach.sum(dim=-1, keepdim=True) - before) * trained


def dpace_total(lm_rows, hidden, head_weight, labels, trained, valid, alpha, norm, chunk_tokens):
    """(loss, correctness) of one batch under D-PACE. `lm_rows(hidden, head, labels, weigh,
    chunk_tokens)` -> (sum of w * CE, correctness, w): the chunked LM head whose weights `weigh`
    draws from each token's CE (`dflash.model.lm_loss.weighted_lm_loss`). trained: (b, n, B)
    bool, valid: (b, n) bool real blocks."""
    shape = trained.shape

    def weigh(ce):
        return dpace_weights(ce.view(shape), trained, alpha).view(-1)

    total, correct, weights = lm_rows(hidden, head_weight, labels, weigh, chunk_tokens)
    count = valid.sum() if norm == "blocks" else weights.sum()
    return total / count.clamp(min=1e-6), correct
