"""Greedy speculative decoding with a DFlash drafter, as a serving engine runs it (batch size 1).

Round: the last committed token x_n (the previous round's bonus, its features not computed yet)
is the anchor; the drafter reads the committed context's features (its own KV cache) and drafts
x_{n+1..n+B-1} in one pass; the target verifies `[x_n, drafts]` in one forward with its KV cache,
the longest prefix where draft == target argmax is accepted, plus the target's next token (bonus).
The target cache is cut back to the committed tokens, and the verified rows' features become the
drafter's new context. Decoding stops as soon as a round commits a stop token (the tokens after it
in that round are dropped and never counted) or `max_new_tokens` tokens, as the public DFlash
reference does. The same loop with no drafts is plain greedy decoding of the target, which is what
every output is checked against (lossless) and what speedups are measured against.

The sessions the rounds run on (the target's static or transformers' cache, the drafter's) are in
`dflash.eval.sessions`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash.eval import ddtree
from dflash.eval.lookup import prompt_lookup_draft
from dflash.eval.sessions import DrafterSession
from dflash.model.graphs import capture_seconds


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), ending at a stop token or the limit
    accepted: list[int] = field(default_factory=list)  # per verify round: tokens committed
    seconds: float = 0.0  # decoding after the prompt's forward (as the reference times it)
    setup_s: float = 0.0  # CUDA graph captures and compiles: one-off, not in `seconds`

    @property
    def rounds(self) -> int:
        return len(self.accepted)


class Proposer:
    """What drafts each round: nothing (target-only), the drafter, or prompt lookup."""

    block_size = 1

    def start(self, prompt: list[int], features: torch.Tensor, capacity: int) -> None:
        pass

    def propose(self, committed: list[int], features: torch.Tensor) -> list[int]:
        """Draft tokens to follow `committed` (whose last token is the anchor). `features` are
        the target features of committed tokens not yet reported (all but the anchor)."""
        return []


class DrafterProposer(Proposer):
    def __init__(self, drafter, embed_tokens, head_weight):
        self.parts = (drafter, embed_tokens, head_weight)
        self.block_size = drafter.config.block_size

    def start(self, prompt, features, capacity):
        if not hasattr(self, "session"):
            self.session = DrafterSession(*self.parts)
        self.session.reset(capacity)

    def propose(self, committed, features):
        return self.session.draft_logits(committed[-1], features).argmax(-1).tolist()


def _stop(new: list[int], room: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """The tokens of a round that are really committed: none past the limit or a stop token."""
    new = new[:room]
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1], True
    return new, len(new) == room


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start(target, proposer: Proposer, prompt: list[int], max_new_tokens: int, extra: int):
    """Prefill the prompt; returns (first token, its features, the decode clock's start)."""
    capacity = len(prompt) + max_new_tokens + max(extra, proposer.block_size)
    target.reset(capacity)
    next_tokens, features = target.forward(prompt)
    proposer.start(prompt, features, capacity)
    first = int(next_tokens[-1])
    _sync(target.device)
    return first, features, time.perf_counter()


def _stop_clock(gen: Generation, target, proposer: Proposer, started: float, setup: float):
    _sync(target.device)
    gen.setup_s = capture_seconds(target, proposer) - setup
    gen.seconds = time.perf_counter() - started - gen.setup_s


def generate(
    target, proposer: Proposer, prompt: list[int], max_new_tokens: int, eos_ids: set[int]
) -> Generation:
    """Greedy decoding of `prompt` with drafts from `proposer`, verified by `target`."""
    first, pending, started = _start(target, proposer, prompt, max_new_tokens, proposer.block_size)
    setup = capture_seconds(target, proposer)
    committed = [*prompt, first]
    gen = Generation(tokens=[first])
    done = first in eos_ids or max_new_tokens <= 1
    while not done:
        room = max_new_tokens - len(gen.tokens)
        drafts = proposer.propose(committed, pending)[:room]
        anchor_at = len(committed) - 1
        verified, features = target.forward([committed[-1], *drafts])
        verified = verified.tolist()
        n = 0
        while n < len(drafts) and drafts[n] == verified[n]:
            n += 1
        new, done = _stop([*drafts[:n], verified[n]], room, eos_ids)
        target.crop(anchor_at + len(new))  # keep the anchor and the accepted drafts
        pending = features[: n + 1]
        committed += new
        gen.tokens += new
        gen.accepted.append(len(new))
    _stop_clock(gen, target, proposer, started, setup)
    return gen


def generate_tree(
    target,
    proposer: DrafterProposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    budget: int | None,
    topk: int = 8,
    lookup: bool = False,
) -> Generation:
    """DDTree: `generate` with a best-first tree of `budget` drafts from one drafter pass,
    verified in one target forward under an ancestor-only mask (see `dflash.eval.ddtree`).

    `budget` None: the drafter's chain (its argmax per position) is the tree. `lookup`: prompt
    lookup's continuation joins the tree as one more branch (up to B-1 nodes more), so a round
    accepts whichever of the two the target follows further, at no cost in exactness.
    """
    bsz = proposer.block_size
    extra = (budget or bsz - 1) + (bsz - 1 if lookup else 0) + 1
    first, pending, started = _start(target, proposer, prompt, max_new_tokens, extra)
    setup = capture_seconds(target, proposer)
    committed = [*prompt, first]
    gen = Generation(tokens=[first])
    done = first in eos_ids or max_new_tokens <= 1
    while not done:
        room = max_new_tokens - len(gen.tokens)
        root = committed[-1]
        logits = proposer.session.draft_logits(root, pending)
        if budget is None:
            tree = ddtree.chain_tree(root, logits.argmax(-1).tolist())
        else:
            tree = ddtree.build_tree(root, logits.float(), budget, topk)
        if lookup:
            tree = ddtree.with_path(tree, prompt_lookup_draft(committed, bsz - 1))
        prefix = len(committed) - 1
        verified, features = target.forward_tree(tree, prefix)
        path, bonus = ddtree.walk(tree, verified.cpu())
        target.keep_path(path, prefix)
        pending = features[torch.tensor([0, *path], device=features.device)]
        new, done = _stop(ddtree.accepted_tokens(tree, path, bonus), room, eos_ids)
        committed += new
        gen.tokens += new
        gen.accepted.append(len(new))
    _stop_clock(gen, target, proposer, started, setup)
    return gen
