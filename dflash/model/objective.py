"""The DFlash training objective: anchors, blocks, the attention mask, and the weighted loss.

For each sample, up to `max_anchors` anchor positions `a` (both `a` and `a+1` trainable) are drawn
from a seeded generator. Block n is `[ids[a], MASK x (B-1)]` at positions `a .. a+B-1`; it sees the
target's context features strictly before its anchor and its own block (both directions), nothing
else. The loss is CE on `ids[a+k]` for slots k = 1..B-1 with weight `exp(-(k-1)/gamma)` times the
loss mask at `a+k`, normalised by the weight sum (or, with `drafter.loss: dpace`, weights drawn
from the drafter's own confidence: `dflash.model.dpace`). The number of blocks per sample is always
`min(max_anchors, s)` for a batch `s` tokens wide (missing ones are padding that sees nothing), so
shapes, and compiled kernels, depend on the batch shape only, never on how many anchors a sample
happened to have; a sample cannot have `s` anchors, so blocks past that would only be padding.

The mask has one definition (`dflash_mask_mod`) and two realisations: a flex_attention BlockMask
(GPU) and a dense boolean mask for scaled_dot_product_attention (CPU, where torch's flex_attention
has no backward).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.model.dpace import dpace_total
from dflash.model.lm_loss import chunked_lm_loss, weighted_lm_loss
from dflash.model.transfer import upload


def default_gamma(block_size: int) -> float:
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


@dataclass
class Blocks:
    anchors: torch.Tensor  # (b, n) anchor positions (0 for padding blocks)
    valid: torch.Tensor  # (b, n) bool: a real block
    ids: torch.Tensor  # (b, n*B) block token ids
    positions: torch.Tensor  # (b, n*B) RoPE positions
    labels: torch.Tensor  # (b, n, B) target ids (slot 0 unused)
    weights: torch.Tensor  # (b, n, B) loss weights (slot 0 and padding are 0)


# Tokens a-2..a+1 seen together earlier in the row: prompt lookup, matching the last three
# committed tokens, could have proposed token a+1 after anchor a (the answer copies its context)
COPY_NGRAM = 4


def copies_context(input_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) bool: True at anchor a where the n-gram a-2..a+1 (COPY_NGRAM) occurred earlier in
    the row, as where a later turn repeats an earlier answer. Hashes of the n-grams, stably sorted:
    an n-gram equal to the one before it in sorted order was seen earlier (collisions of the
    64-bit hash are negligible)."""
    b, s = input_ids.shape
    n = COPY_NGRAM
    out = torch.zeros(b, s, dtype=torch.bool, device=input_ids.device)
    if s < n:
        return out
    ids = input_ids.long()
    h = torch.zeros(b, s - n + 1, dtype=torch.long, device=ids.device)
    for i in range(n):  # int64 arithmetic wraps: a hash, not a number
        h = h * 1_000_003 + ids[:, i : s - n + 1 + i]
    order = torch.sort(h, dim=1, stable=True)
    seen = torch.zeros_like(h, dtype=torch.bool)
    seen.scatter_(1, order.indices[:, 1:], order.values[:, 1:] == order.values[:, :-1])
    out[:, n - 2 : s - 1] = seen  # h[:, j] is the n-gram of anchor j + n - 2
    return out


def sample_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator,
    input_ids: torch.Tensor | None = None,
    copy_weight: float = 1.0,
):
    """Up to `max_anchors` sorted anchors per sample where positions a and a+1 are trainable:
    (b, min(max_anchors, s)) anchors and validity, real anchors first. With `copy_weight` w != 1
    an anchor where the answer copies its context (`copies_context(input_ids)`) is drawn w times
    as likely as another (drafter.copy_anchor_weight)."""
    b, s = loss_mask.shape
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    eligible[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    # Random keys on CPU from the seeded generator: the same draw on every device.
    keys = upload(torch.rand((b, s), generator=generator), loss_mask.device)
    if copy_weight != 1.0:
        # Efraimidis-Spirakis: the k smallest Exp(w)-distributed keys (-log u / w) are a draw of k
        # without replacement, each in proportion to its w; x / (1 + x) keeps their order in [0, 1)
        weight = 1.0 + (copy_weight - 1.0) * copies_context(input_ids).float()
        keys = -torch.log(keys) / weight
        keys = keys / (1.0 + keys)
    keys = torch.where(eligible, keys, torch.full_like(keys, 2.0))
    k = min(max_anchors, s)
    picked = keys.topk(k, dim=1, largest=False)
    valid = picked.values < 2.0
    anchors = torch.where(valid, picked.indices, torch.zeros_like(picked.indices))
    # Sort real anchors ascending, padding last.
    order = torch.where(valid, anchors, torch.full_like(anchors, s)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def make_blocks(
    input_ids, loss_mask, anchors, valid, block_size: int, mask_token_id: int, gamma: float
) -> Blocks:
    b, s = input_ids.shape
    n = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + offsets  # (b, n, B)
    in_seq = pos < s
    flat = pos.clamp(max=s - 1).view(b, -1)

    def gathered(t):  # t at each block position, 0 past the sequence end
        return torch.where(in_seq, t.gather(1, flat).view(b, n, -1), 0)

    labels = gathered(input_ids)
    mask_at = gathered(loss_mask).bool()
    # slot 0 (the anchor itself) is given, not trained; no in-place scalar write: on a GPU that
    # is a host-to-device copy that waits for the device
    slot_weight = torch.where(offsets > 0, torch.exp(-(offsets.float() - 1) / gamma), 0.0)
    weights = slot_weight * (mask_at & valid[:, :, None])
    ids = torch.full(
        (b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return Blocks(anchors, valid, ids.view(b, -1), pos.view(b, -1), labels, weights.float())


def dflash_mask_mod(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int):
    """mask_mod(b, h, q, kv): may block query q of sample b attend to key kv?

    Keys are `[context (ctx_len); block tokens (n*B)]`. Written with tensor ops only, so it
    works both inside flex_attention and when broadcast over index grids.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        real = valid[b, block]
        sees_context = (kv_idx < ctx_len) & (kv_idx < anchor)
        own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == block)
        return real & (sees_context | own_block)

    return mask_mod


def dense_mask(mask_mod, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """(b, q, kv) bool, evaluating mask_mod on broadcast index grids."""
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    return mask_mod(b, 0, q, kv)


@functools.cache
def compiled_flex(fn_name: str, dynamic: bool | None = None):
    """torch.nn.attention.flex_attention's `fn_name` through `torch.compile`, wrapped once per
    process. Each call of `torch.compile` copies the compiler's whole config: wrapping anew at
    every training step (as create_block_mask's `_compile=True` does) cost the host 2 x 7 ms of
    the recipe's step on an H100 host, a third of its time there (cProfile, 2026-12-07); the
    graphs are the same either way."""
    from torch.nn.attention import flex_attention

    return torch.compile(getattr(flex_attention, fn_name), dynamic=dynamic)


def block_mask(mask_mod, batch: int, q_len: int, kv_len: int, device, compile: bool = False):
    from torch.nn.attention.flex_attention import create_block_mask

    make = compiled_flex("create_block_mask") if compile else create_block_mask
    return make(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


def sdpa_attend(mask: torch.Tensor):
    """Attention with a dense mask. Rows that see nothing (padding blocks) output zeros, as in
    flex_attention; they are given a harmless full row first, since an all-False row makes SDPA
    return NaN and poisons the backward pass."""
    empty = ~mask.any(-1, keepdim=True)  # (b, q, 1)
    safe = (mask | empty)[:, None]

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, enable_gqa=True)
        return out.masked_fill(empty[:, None], 0.0)

    return attend


def flex_attend(mask, compiled: bool = False):
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled_flex("flex_attention", dynamic=False) if compiled else flex_attention

    def attend(q, k, v):
        return fn(q, k, v, block_mask=mask, enable_gqa=True)

    return attend


def full_attend(q, k, v):
    """Inference: the block sees all cached context and itself."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def block_metrics(correct: torch.Tensor, blocks: Blocks) -> dict:
    """Accuracy per slot and teacher-forced τ over real blocks (slot 0 is given, so τ counts it),
    as device tensors: no host sync, so the training step never waits for the GPU here
    (`host_metrics` converts them). NaN when the batch has no real block.

    A slot whose label is untrainable or past the sequence counts as a miss, so τ is what a
    verifier would accept on this data, never more.
    """
    b, n, bs = blocks.labels.shape
    ok = (correct.view(b, n, bs)[:, :, 1:] & (blocks.weights[:, :, 1:] > 0)).float()
    real = blocks.valid.float()  # (b, n)
    count = real.sum()
    accepted = ok.cumprod(dim=2).sum(dim=2)  # (b, n): slots accepted before the first miss
    return {
        "tau": 1.0 + (accepted * real).sum() / count,
        "acc": (ok * real[:, :, None]).sum(dim=(0, 1)) / count,
        "blocks": count,
    }


def host_metrics(metrics: dict) -> dict:
    """A step's metrics as Python numbers (one host sync); a non-finite loss reads NaN."""
    out = {
        "tau": float(metrics["tau"]),
        "acc": metrics["acc"].tolist(),
        "blocks": int(metrics["blocks"]),
    }
    loss = float(metrics["loss"])
    out["loss"] = loss if math.isfinite(loss) else float("nan")
    return out


def dflash_loss(
    drafter,
    embed_tokens,
    head_weight,
    features,
    input_ids,
    loss_mask,
    generator,
    max_anchors: int,
    gamma: float | None = None,
    backend: str = "sdpa",
    chunk_tokens: int = 1024,
    compiled_flex: bool = False,
    compiled_ce: bool = False,
    lm_loss=None,
    distill: float = 0.0,
    host: bool = True,
    copy_weight: float = 1.0,
    dpace: dict | None = None,
):
    """One training forward: returns (loss, metrics); the metrics as device tensors when not
    `host` (`host_metrics` converts them later). features: (b, s, n_layers*H), with the
    target's normed output appended ((b, s, (n_layers+1)*H)) when `distill` > 0: the label of
    slot k is then the one-hot token mixed with the target's own next-token distribution at
    a+k-1 (weight `distill`), which says how sure the target was and what else it considered.

    `lm_loss(hidden, head_weight, labels, weights, chunk_tokens)` -> (weighted CE sum,
    correctness), default `chunked_lm_loss` (compiled if `compiled_ce`); bench/gpu.py swaps in
    its references (full logits, checkpointed chunks).

    `dpace` ({"alpha", "norm"}; drafter.loss: dpace) weighs the slots by D-PACE instead of
    exp(-(k-1)/gamma) (`dflash.model.dpace`); hard labels only, so not with `distill`.
    """
    cfg = drafter.config
    bs = cfg.block_size
    gamma = gamma or default_gamma(bs)
    b, s = input_ids.shape
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    need = width + (cfg.hidden_size if distill else 0)
    if features.shape[-1] != need:
        what = "the target layers' features" + (", then the target's output" if distill else "")
        raise ValueError(f"features are {features.shape[-1]} wide; the step needs {need}: {what}")
    target_out = features[..., width:] if distill else None
    features = features[..., :width] if distill else features
    anchors, valid = sample_anchors(loss_mask, max_anchors, generator, input_ids, copy_weight)
    blocks = make_blocks(input_ids, loss_mask, anchors, valid, bs, cfg.mask_token_id, gamma)
    q_len, kv_len = blocks.ids.shape[1], s + blocks.ids.shape[1]
    mod = dflash_mask_mod(anchors, valid, s, bs)
    if backend == "flex":
        attend = flex_attend(
            block_mask(mod, b, q_len, kv_len, input_ids.device, compile=compiled_flex),
            compiled=compiled_flex,
        )
    else:
        attend = sdpa_attend(dense_mask(mod, b, q_len, kv_len, input_ids.device))
    ctx_positions = torch.arange(s, device=input_ids.device).expand(b, s)
    with torch.no_grad():
        block_embeds = embed_tokens(blocks.ids)
    hidden = drafter(
        block_embeds.to(features.dtype), features, blocks.positions, ctx_positions, attend
    )
    if dpace is not None:
        if distill:
            raise ValueError("D-PACE weighs hard labels: it cannot run with distillation")
        loss, correct = dpace_total(
            functools.partial(weighted_lm_loss, compiled=compiled_ce),
            hidden.reshape(-1, hidden.shape[-1]),
            head_weight,
            blocks.labels.view(-1),
            blocks.weights > 0,
            blocks.valid,
            dpace["alpha"],
            dpace["norm"],
            chunk_tokens,
        )
        metrics = {**block_metrics(correct, blocks), "loss": loss.detach()}
        return loss, host_metrics(metrics) if host else metrics
    weights = blocks.weights.view(-1)
    if lm_loss is None:
        lm_loss = functools.partial(chunked_lm_loss, compiled=compiled_ce)
    if distill:
        # slot k's label is the token at a+k; the target predicted it from position a+k-1
        source = (blocks.positions - 1).clamp(0, s - 1)
        soft = target_out.gather(1, source[:, :, None].expand(-1, -1, target_out.shape[-1]))
        lm_loss = functools.partial(lm_loss, soft=(soft.reshape(-1, soft.shape[-1]), distill))
    total, correct = lm_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        head_weight,
        blocks.labels.view(-1),
        weights,
        chunk_tokens,
    )
    denom = weights.sum().clamp(min=1e-6)
    loss = total / denom
    metrics = {**block_metrics(correct, blocks), "loss": loss.detach()}
    return loss, host_metrics(metrics) if host else metrics
