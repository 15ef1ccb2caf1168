"""Simulated acceptance length (`tau_sim`): what greedy speculative decoding would accept on a
known response, from teacher-forced drafter blocks, computed during training or evaluation.

Real decoding is a walk. The first response token comes from the prompt's forward; it is the
first anchor. Each round drafts the B-1 tokens after the anchor, accepts the longest prefix that
equals the target's own continuation, commits it plus the target's next token, and the next anchor
is the last committed token: the anchor jumps by accepted + 1. On a response the target itself
produced (regenerated data), the target's next tokens are the response, and a block depends only
on the context before its anchor, so every block can be drafted from one teacher-forced pass and
the walk read off them. Decoding stops once it commits the response's last token (the stop token)
or `max_new_tokens` tokens; the round that reaches it counts only the tokens up to it.

The mean over teacher-forced anchors (the training loss's τ) overstates this: the walk lands more
often where the drafter fails, since where it succeeds it jumps ahead. Per response the rounds are
averaged, then responses are averaged: the macro mean that real decoding reports (`tau_macro`).
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext

import torch

from dflash.model.objective import dense_mask, dflash_mask_mod, make_blocks, sdpa_attend


def response_spans(loss_mask) -> list[tuple[int, int]]:
    """(first, last) positions of each run of trainable tokens: one assistant turn each."""
    spans, start = [], None
    mask = list(loss_mask)
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i - 1))
            start = None
    if start is not None:
        spans.append((start, len(mask) - 1))
    return spans


def walk(matches: list[int], first: int, last: int) -> list[int]:
    """Tokens committed per round when decoding from `first` to `last` (inclusive).

    `matches[a - first]`: how many drafts after anchor `a` equal the response (counting only
    positions up to `last`).
    """
    rounds, a = [], first
    while a < last:
        accepted = min(matches[a - first] + 1, last - a)
        rounds.append(accepted)
        a += accepted
    return rounds


@torch.no_grad()
def drafted_blocks(drafter, embed_tokens, features, ids, chunk):
    """The blocks anchored at `chunk` (1, n) positions of `ids` (s,) and the drafter's last hidden
    state at each of their slots (n, B, hidden), under the training mask (teacher forcing)."""
    cfg = drafter.config
    bs, s, device = cfg.block_size, ids.shape[0], ids.device
    valid = torch.ones_like(chunk, dtype=torch.bool)
    blocks = make_blocks(
        ids[None], torch.ones_like(ids)[None], chunk, valid, bs, cfg.mask_token_id, 1.0
    )
    q_len = blocks.ids.shape[1]
    mask = dense_mask(dflash_mask_mod(chunk, valid, s, bs), 1, q_len, s + q_len, device)
    hidden = drafter(
        embed_tokens(blocks.ids).to(features.dtype),
        features,
        blocks.positions,
        torch.arange(s, device=device)[None],
        sdpa_attend(mask),
    )[0].view(-1, bs, cfg.hidden_size)
    return blocks, hidden


def block_matches(
    drafter, embed_tokens, head_weight, features, ids, anchors, last, chunk_anchors: int = 256
) -> torch.Tensor:
    """For each anchor, how many of its B-1 drafts (argmax) equal `ids` after it, up to `last`.

    features: (1, s, n*H) target features of `ids` (s,); anchors: (n,) positions. Slots are read
    in order and only for anchors whose earlier slots all matched, so the LM head (the costly
    part) runs on about τ slots per anchor instead of B-1.
    """
    bs = drafter.config.block_size
    device = head_weight.device
    ids = ids.to(device)
    out = []
    for lo in range(0, anchors.numel(), chunk_anchors):
        chunk = anchors[lo : lo + chunk_anchors].to(device)[None]
        blocks, hidden = drafted_blocks(drafter, embed_tokens, features, ids, chunk)
        labels = blocks.labels[0]
        in_range = blocks.positions[0].view(-1, bs) <= last
        matched = torch.zeros(chunk.shape[1], dtype=torch.long, device=device)
        for k in range(1, bs):
            alive = (matched == k - 1) & in_range[:, k]
            if not alive.any():
                break
            logits = hidden[alive, k].to(head_weight.dtype) @ head_weight.T
            matched[alive] += (logits.argmax(-1) == labels[alive, k]).long()
        out.append(matched)
    return torch.cat(out).cpu()


def simulate(
    drafter,
    embed_tokens,
    head_weight,
    rows,
    max_new_tokens: int | None = None,
    autocast: torch.dtype | None = None,
) -> list[list[int]]:
    """Rounds (tokens committed per target forward) of every response in `rows`, in order (an
    empty list for a response with nothing to draft).

    rows: (features (1, s, n*H), input_ids (s,), loss_mask (s,)) per conversation; each assistant
    turn (a run of trainable tokens) is one response, decoded after the context before it.
    `max_new_tokens` caps each response as decoding does (None: the whole response).
    """
    device = head_weight.device
    cast = torch.autocast(device.type, dtype=autocast) if autocast else nullcontext()
    was_training = drafter.training
    drafter.eval()
    per_response = []
    try:
        with cast:
            for features, ids, loss_mask in rows:
                for first, end in response_spans(loss_mask.tolist()):
                    last = end if max_new_tokens is None else min(end, first + max_new_tokens - 1)
                    if last <= first:  # nothing to draft; kept so responses stay aligned
                        per_response.append([])
                        continue
                    anchors = torch.arange(first, last)
                    matches = block_matches(
                        drafter, embed_tokens, head_weight, features, ids, anchors, last
                    )
                    per_response.append(walk(matches.tolist(), first, last))
    finally:
        drafter.train(was_training)
    return per_response


def capped(rounds: list[int], max_new_tokens: int) -> list[int]:
    """The rounds of a walk cut where decoding capped at `max_new_tokens` would stop (the first
    token comes from the prompt's forward, so the rounds commit at most max_new_tokens - 1): a
    walk's rounds depend only on what came before them, so the capped walk is this prefix."""
    out, left = [], max_new_tokens - 1
    for r in rounds:
        if left <= 0:
            break
        out.append(min(r, left))
        left -= out[-1]
    return out


def tau_macro(per_response: list[list[int]]) -> float | None:
    """Mean over responses of each response's mean tokens per round."""
    means = [statistics.fmean(r) for r in per_response if r]
    return round(statistics.fmean(means), 4) if means else None
