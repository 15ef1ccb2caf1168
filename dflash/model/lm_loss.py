"""The drafter's language-model loss over its block positions, one chunk of logits at a time.

A 150K-token vocabulary times every block slot of a batch would not fit as one logits tensor, so
the loss runs chunk by chunk: `chunked_lm_loss` (the training default) computes each chunk's
hidden-state gradient in the forward pass, so the backward pass only scales it, and optionally
compiles each chunk's softmax and gradient into two kernels; `checkpointed_lm_loss` is the
previous recompute-in-backward version, kept as bench/gpu.py's reference. Soft labels (the
target's own distribution mixed into the one-hot label, `train.distill`) go through the same
chunks. `weighted_lm_loss` is the same fused CE whose token weights are drawn from the tokens' own
CE once every chunk has run (D-PACE, `dflash.model.dpace`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_ce(hidden, head_weight, labels, weights):
    logits = (hidden @ head_weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(-1) == labels
    return (ce * weights).sum(), correct


def checkpointed_lm_loss(hidden, head_weight, labels, weights, chunk_tokens: int = 4096):
    """The previous CE: each chunk checkpointed, its logits recomputed in the backward pass.

    Kept as the side-by-side reference for `chunked_lm_loss` (bench/gpu.py).
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and hidden.requires_grad:
            loss, ok = checkpoint(
                _chunk_ce, hidden[sl], head_weight, labels[sl], weights[sl], use_reentrant=False
            )
        else:
            loss, ok = _chunk_ce(hidden[sl], head_weight, labels[sl], weights[sl])
        total = total + loss
        correct.append(ok)
    return total, torch.cat(correct)


def _ce_sum(x, labels, weights):
    """(logsumexp, weighted CE sum, correctness) of fp32 logits x."""
    lse = torch.logsumexp(x, dim=-1)
    total = ((lse - x.gather(1, labels[:, None]).squeeze(1)) * weights).sum()
    return lse, total, x.argmax(-1) == labels


def _ce_chunk(logits, labels, weights, want_grad: bool):
    """(weighted CE sum, correctness, d sum / d logits in the logits' dtype or None) of one chunk
    of logits; the softmax in fp32. Written for torch.compile (one reduction, one pointwise
    kernel); `_ce_chunk_eager` is the same function with in-place ops for eager mode."""
    x = logits.float()
    lse, total, correct = _ce_sum(x, labels, weights)
    if not want_grad:
        return total, correct, None
    # d/dlogits of sum(w * (lse - logit_y)) = w * (softmax - onehot(y))
    onehot = torch.arange(x.shape[1], device=x.device)[None] == labels[:, None]
    g = (torch.exp(x - lse[:, None]) - onehot.float()) * weights[:, None]
    return total, correct, g.to(logits.dtype)


def _ce_chunk_eager(logits, labels, weights, want_grad: bool):
    x = logits.float()
    lse, total, correct = _ce_sum(x, labels, weights)
    if not want_grad:
        return total, correct, None
    g = x.sub_(lse[:, None]).exp_()  # softmax, in place
    g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
    return total, correct, g.mul_(weights[:, None]).to(logits.dtype)


def _soft_ce_chunk(logits, target_logits, labels, weights, distill: float, want_grad: bool):
    """`_ce_chunk` against a soft label: the one-hot label mixed with the target's own softmax
    at that position (weight `distill`): CE = lse - sum(label * logits), gradient
    softmax - label. Correctness stays argmax == the token."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    onehot = (torch.arange(x.shape[1], device=x.device)[None] == labels[:, None]).float()
    label = (1.0 - distill) * onehot + distill * torch.softmax(target_logits.float(), dim=-1)
    total = ((lse - (label * x).sum(-1)) * weights).sum()
    correct = x.argmax(-1) == labels
    if not want_grad:
        return total, correct, None
    g = (torch.exp(x - lse[:, None]) - label) * weights[:, None]
    return total, correct, g.to(logits.dtype)


@functools.cache
def _compiled(fn):
    """Compiled: ~3 passes over a chunk's bf16 logits instead of ~10 eager passes over fp32 ones
    (bench/gpu.py measures both). Wrapped on first use: `torch.compile` imports inductor (1.2 s
    of every process that reads this module, compiling or not)."""
    return torch.compile(fn, dynamic=False)


def _fused_ce(hidden, head_weight, labels, weights, chunk_tokens, want_grad, compiled, soft=None):
    """(sum of weighted CE, correctness, d total / d hidden or None), one chunk of logits at a
    time. Matmuls run in the head's dtype. `soft`: (target hidden (T, H), distill) for soft
    labels, the target's logits computed chunk by chunk from its normed output."""
    ce_chunk = _compiled(_ce_chunk) if compiled else _ce_chunk_eager
    soft_chunk = _compiled(_soft_ce_chunk) if compiled else _soft_ce_chunk
    n = hidden.shape[0]
    grad_hidden = torch.empty_like(hidden) if want_grad else None
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
    for start in range(0, n, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        logits = hidden[sl].to(head_weight.dtype) @ head_weight.t()
        if soft is None:
            loss, correct[sl], g = ce_chunk(logits, labels[sl], weights[sl].float(), want_grad)
        else:
            target_hidden, distill = soft
            target_logits = target_hidden[sl].to(head_weight.dtype) @ head_weight.t()
            loss, correct[sl], g = soft_chunk(
                logits, target_logits, labels[sl], weights[sl].float(), distill, want_grad
            )
        total = total + loss
        if want_grad:
            grad_hidden[sl] = g @ head_weight
    return total, correct, grad_hidden


class _FusedLinearCE(torch.autograd.Function):
    """The hidden-state gradient is computed in the forward pass and only scaled in the backward
    pass. The head is frozen: it gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, chunk_tokens, compiled, soft):
        total, correct, grad_hidden = _fused_ce(
            hidden, head_weight, labels, weights, chunk_tokens, True, compiled, soft
        )
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


def chunked_lm_loss(
    hidden,
    head_weight,
    labels,
    weights,
    chunk_tokens: int = 1024,
    compiled: bool = False,
    soft=None,
):
    """sum(weights * CE(hidden @ head.T, labels)) and per-token correctness.

    Logits exist for one chunk at a time. With gradients, each chunk's hidden-state gradient is
    computed in the forward pass (`_FusedLinearCE`), so the backward pass only scales it: two
    head matmuls per chunk instead of the three of a checkpointed chunk, and no full logits.
    hidden: (T, H), labels/weights: (T,). The head gets no gradient (it is frozen). `compiled`
    fuses each chunk's softmax and gradient into two kernels (torch.compile). `soft`:
    (the target's normed output at each label's previous position (T, H), distill weight).
    """
    if torch.is_grad_enabled() and hidden.requires_grad:
        return _FusedLinearCE.apply(
            hidden, head_weight, labels, weights, chunk_tokens, compiled, soft
        )
    total, correct, _ = _fused_ce(
        hidden, head_weight, labels, weights, chunk_tokens, False, compiled, soft
    )
    return total, correct


def _ce_rows(logits, labels, want_grad: bool):
    """(CE per row, correctness, d CE_row / d logits or None) of one chunk of logits, unweighted;
    the softmax in fp32. For torch.compile, as `_ce_chunk`; `_ce_rows_eager` works in place."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    correct = x.argmax(-1) == labels
    if not want_grad:
        return ce, correct, None
    onehot = torch.arange(x.shape[1], device=x.device)[None] == labels[:, None]
    return ce, correct, (torch.exp(x - lse[:, None]) - onehot.float()).to(logits.dtype)


def _ce_rows_eager(logits, labels, want_grad: bool):
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    correct = x.argmax(-1) == labels
    if not want_grad:
        return ce, correct, None
    g = x.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
    return ce, correct, g.to(logits.dtype)


def _rows_ce(hidden, head_weight, labels, chunk_tokens, want_grad, compiled):
    """(CE per token (T,) fp32, correctness, unweighted d CE_t / d hidden_t (T, H) or None)."""
    rows = _compiled(_ce_rows) if compiled else _ce_rows_eager
    n = hidden.shape[0]
    grad_hidden = torch.empty_like(hidden) if want_grad else None
    ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
    correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
    for start in range(0, n, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        logits = hidden[sl].to(head_weight.dtype) @ head_weight.t()
        ce[sl], correct[sl], g = rows(logits, labels[sl], want_grad)
        if want_grad:
            grad_hidden[sl] = g @ head_weight
    return ce, correct, grad_hidden


class _WeightedLinearCE(torch.autograd.Function):
    """`_FusedLinearCE` with weights that depend on the CE itself: the per-token CE and its
    unweighted hidden-state gradient come first, then `weigh(ce)` (detached), then each token's
    gradient row is scaled by its weight. No more head matmuls than the default loss."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weigh, chunk_tokens, compiled):
        ce, correct, grad_hidden = _rows_ce(
            hidden, head_weight, labels, chunk_tokens, True, compiled
        )
        weights = weigh(ce)
        grad_hidden.mul_(weights[:, None].to(grad_hidden.dtype))
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct, weights)
        return (ce * weights).sum(), correct, weights

    @staticmethod
    def backward(ctx, grad_total, grad_correct, grad_weights):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None


def weighted_lm_loss(
    hidden, head_weight, labels, weigh, chunk_tokens: int = 1024, compiled: bool = False
):
    """(sum(w * CE), correctness, w) where w = weigh(CE per token) (T,), detached: the weights
    see every chunk's CE before any gradient is scaled. hidden: (T, H), labels: (T,)."""
    if torch.is_grad_enabled() and hidden.requires_grad:
        return _WeightedLinearCE.apply(hidden, head_weight, labels, weigh, chunk_tokens, compiled)
    ce, correct, _ = _rows_ce(hidden, head_weight, labels, chunk_tokens, False, compiled)
    weights = weigh(ce)
    return (ce * weights).sum(), correct, weights
