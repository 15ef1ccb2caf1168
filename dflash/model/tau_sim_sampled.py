"""tau_sim at a temperature: the τ that speculative sampling would reach on a known response,
expected rather than walked, from one teacher-forced pass of the drafter.

At temperature 0 (`dflash.model.tau_sim`) a round accepts the drafts that equal the response and
the walk is fixed. At a temperature the drafter still drafts its argmax, but the target accepts
draft k with its probability of that token, given everything before it (`dflash.eval.verify`).
A DFlash block depends only on the context before its anchor, so every block's drafts come from
one teacher-forced pass; the target's probabilities are read at the response's own tokens
(the teacher-forced context: exact while the accepted drafts equal the response, an
approximation after a draft that differs was accepted). Draft k after anchor a is then accepted
with chance alpha[a][k] = p_target(d_ak | response up to a + k - 1), the round commits n + 1
tokens with chance alpha_1 ... alpha_n (1 - alpha_{n+1}), and the next anchor is a + n + 1.
`expected_tau` carries the chance of each anchor being visited down the response (a walk's
distribution, not one walk) and returns tokens / expected rounds.

The target's distributions are kept as their `TOP` most likely tokens per position (after
temperature, top-k and top-p): a draft outside them counts as never accepted, which errs low by
at most the mass outside the top tokens. That keeps a held-out slice's targets at a few MB,
where the whole distributions of 24 rows would take gigabytes.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dflash.model.sampling import Sampling, probabilities
from dflash.model.tau_sim import drafted_blocks, response_spans

TOP = 32
# a draft slot whose chance of being reached is below this is not drafted (its LM head is the
# cost); at temperature 0 this is exactly the greedy walk's rule (reached or not)
REACHED = 1e-4


def target_top(logits: torch.Tensor, sampling: Sampling, k: int = TOP):
    """(token ids, probabilities), each (s, k): the most likely next tokens at every position."""
    probs, ids = probabilities(logits, sampling).topk(min(k, logits.shape[-1]), dim=-1)
    return ids.cpu(), probs.cpu()


def expected_tau(alpha: list[list[float]], first: int, last: int) -> float | None:
    """Tokens per round of speculative sampling from `first` to `last` (inclusive), in
    expectation over the walk: alpha[a - first][k - 1] is draft k's chance of acceptance after
    anchor a (0 past `last`). None where there is nothing to draft."""
    if last <= first:
        return None
    visit = [0.0] * (last - first + 1)
    visit[0] = 1.0
    rounds = 0.0
    for a in range(first, last):
        here = visit[a - first]
        if here == 0.0:
            continue
        rounds += here
        reached = 1.0  # the chance that drafts 1..n were all accepted
        chances = alpha[a - first]
        for n in range(len(chances) + 1):
            stop = 1.0 - chances[n] if n < len(chances) else 1.0
            visit[min(a + n + 1, last) - first] += here * reached * stop
            if n < len(chances):
                reached *= chances[n]
            if reached == 0.0:
                break
    return (last - first) / rounds


def argmax_ceiling(best: list[float], first: int, last: int, block_size: int) -> float | None:
    """What drafts of one token a slot (argmax drafts, vLLM's default rule) can reach at this
    temperature: the expected τ of a drafter that always drafts the target's own argmax, whose
    draft k after anchor a is accepted with `best[a + k - 1]`, the target's largest probability
    for the token at a + k (after temperature, top-k and top-p). Read along a known response as
    tau_sim reads a drafter (the contexts are the response's), where no drafter of fixed drafts
    does better. In real decoding an accepted argmax draft makes a surer context than sampled
    text, so it is an estimate that runs a few per cent low (4-5 % on the small test target), not
    a bound. None where there is nothing to draft."""
    alpha = [
        [best[a + k - 1] if a + k <= last else 0.0 for k in range(1, block_size)]
        for a in range(first, last)
    ]
    return expected_tau(alpha, first, last)


@torch.no_grad()
def draft_acceptance(
    drafter, embed_tokens, head_weight, features, ids, top, anchors, last, chunk_anchors=256
) -> torch.Tensor:
    """(anchors, B-1) chances that each anchor's drafts are accepted: the target's probability
    (`top`: its (ids, probs) per position) of the drafter's argmax at each slot, 0 past `last`.
    Slots are drafted in order and only where reached with chance >= `REACHED`."""
    bs = drafter.config.block_size
    device = head_weight.device
    ids = ids.to(device)
    top_ids, top_probs = (t.to(device) for t in top)
    out = []
    for lo in range(0, anchors.numel(), chunk_anchors):
        chunk = anchors[lo : lo + chunk_anchors].to(device)[None]
        blocks, hidden = drafted_blocks(drafter, embed_tokens, features, ids, chunk)
        positions = blocks.positions[0].view(-1, bs)
        n = chunk.shape[1]
        alpha = torch.zeros(n, bs - 1, device=device)
        reached = torch.ones(n, device=device)
        for k in range(1, bs):
            live = (reached >= REACHED) & (positions[:, k] <= last)
            if not live.any():
                break
            logits = hidden[live, k].to(head_weight.dtype) @ head_weight.T
            drafts = logits.argmax(-1)
            at = positions[live, k] - 1  # the target's distribution for the token at a + k
            hit = top_ids[at] == drafts[:, None]
            alpha[live, k - 1] = (top_probs[at] * hit).sum(-1).float()
            reached = reached * alpha[:, k - 1]
        out.append(alpha)
    return torch.cat(out).cpu()


def simulate_sampled(
    drafter,
    embed_tokens,
    head_weight,
    rows,
    max_new_tokens: int | None = None,
    autocast: torch.dtype | None = None,
) -> list[float | None]:
    """Expected τ of every response in `rows`, in order (None for one with nothing to draft).

    rows: (features (1, s, n*H), input_ids (s,), loss_mask (s,), top) per conversation, `top`
    the target's (ids, probs) per position (`target_top`); each assistant turn is one response,
    capped at `max_new_tokens` as decoding caps it (None: the whole response)."""
    device = head_weight.device
    cast = torch.autocast(device.type, dtype=autocast) if autocast else nullcontext()
    was_training = drafter.training
    drafter.eval()
    per_response: list[float | None] = []
    try:
        with cast:
            for features, ids, loss_mask, top in rows:
                for first, end in response_spans(loss_mask.tolist()):
                    last = end if max_new_tokens is None else min(end, first + max_new_tokens - 1)
                    if last <= first:
                        per_response.append(None)
                        continue
                    anchors = torch.arange(first, last)
                    alpha = draft_acceptance(
                        drafter, embed_tokens, head_weight, features, ids, top, anchors, last
                    )
                    per_response.append(expected_tau(alpha.tolist(), first, last))
    finally:
        drafter.train(was_training)
    return per_response
