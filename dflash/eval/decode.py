"""Speculative decoding with a DFlash drafter, as a serving engine runs it (batch size 1).

Round: the last committed token x_n (the previous round's bonus, its features not computed yet)
is the anchor; the drafter reads the committed context's features (its own KV cache) and drafts
x_{n+1..n+B-1} in one pass; the target verifies `[x_n, drafts]` in one forward with its KV cache,
the longest prefix where draft == target argmax is accepted, plus the target's next token (bonus).
The target cache is cut back to the committed tokens, and the verified rows' features become the
drafter's new context. Decoding stops as soon as a round commits a stop token (the tokens after it
in that round are dropped and never counted) or `max_new_tokens` tokens, as the public DFlash
reference does. The same loop with no drafts is plain greedy decoding of the target, which is what
every output is checked against (lossless) and what speedups are measured against.

That is the greedy rule (temperature 0). At a temperature the round's decision is the engines'
speculative sampling instead (`dflash.eval.verify.Sampled`: accept a draft with the target's
probability of it, draw from the rest on rejection), and the same loop without drafts is plain
sampling from the target: lossless in distribution, which a goodness-of-fit test checks.

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
from dflash.eval.verify import Greedy, Sampled
from dflash.model.graphs import capture_seconds
from dflash.model.sampling import probabilities, sample_rows


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), ending at a stop token or the limit
    accepted: list[int] = field(default_factory=list)  # per verify round: tokens committed
    seconds: float = 0.0  # decoding after the prompt's forward (as the reference times it)
    setup_s: float = 0.0  # CUDA graph captures and compiles: one-off, not in `seconds`

    @property
    def rounds(self) -> int:
        return len(self.accepted)


GREEDY = Greedy()


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

    def draft_logits(self, committed: list[int], features) -> torch.Tensor:
        """(B-1, V) logits of the drafts after `committed` (its last token is the anchor)."""
        return self.session.draft_logits(committed[-1], features)

    def propose(self, committed, features):
        return self.draft_logits(committed, features).argmax(-1).tolist()


class SampledDrafts(Proposer):
    """`drafter`'s tokens drawn from its own distribution at the rule's sampling parameters,
    with the generator the rule verifies with (vLLM's `draft_sample_method: probabilistic`);
    `draft_probs` keeps the distributions the last drafts came from, for the ratio test."""

    def __init__(self, drafter: DrafterProposer, rule: Sampled):
        self.drafter, self.rule = drafter, rule
        self.block_size = drafter.block_size
        self.draft_probs: torch.Tensor | None = None

    @property
    def session(self):  # its CUDA graphs' capture time is kept off the clock (capture_seconds)
        return getattr(self.drafter, "session", None)

    def start(self, prompt, features, capacity):
        self.drafter.start(prompt, features, capacity)

    def propose(self, committed, features):
        logits = self.drafter.draft_logits(committed, features)
        self.draft_probs = probabilities(logits, self.rule.sampling)
        return sample_rows(self.draft_probs, self.rule.generator).tolist()


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


def _start(target, proposer: Proposer, prompt, max_new_tokens: int, extra: int, rule):
    """Prefill the prompt; returns (first token, its features, the decode clock's start)."""
    capacity = len(prompt) + max_new_tokens + max(extra, proposer.block_size)
    target.reset(capacity)
    next_tokens, features = target.forward(prompt, rule.logits)
    proposer.start(prompt, features, capacity)
    first = rule.first(next_tokens)
    _sync(target.device)
    return first, features, time.perf_counter()


def _stop_clock(gen: Generation, target, proposer: Proposer, started: float, setup: float):
    _sync(target.device)
    gen.setup_s = capture_seconds(target, proposer) - setup
    gen.seconds = time.perf_counter() - started - gen.setup_s


def generate(
    target,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    rule: Greedy | Sampled = GREEDY,
) -> Generation:
    """Decoding of `prompt` with drafts from `proposer`, verified by `target` under `rule`
    (greedy, or speculative sampling at a temperature)."""
    bsz = proposer.block_size
    first, pending, started = _start(target, proposer, prompt, max_new_tokens, bsz, rule)
    setup = capture_seconds(target, proposer)
    committed = [*prompt, first]
    gen = Generation(tokens=[first])
    done = first in eos_ids or max_new_tokens <= 1
    while not done:
        room = max_new_tokens - len(gen.tokens)
        drafts = proposer.propose(committed, pending)[:room]
        anchor_at = len(committed) - 1
        verified, features = target.forward([committed[-1], *drafts], rule.logits)
        q = getattr(proposer, "draft_probs", None)
        decided = rule.chain(drafts, verified, None if q is None else q[: len(drafts)])
        n = len(decided) - 1  # drafts accepted
        new, done = _stop(decided, room, eos_ids)
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
    rule: Greedy | Sampled = GREEDY,
) -> Generation:
    """DDTree: `generate` with a best-first tree of `budget` drafts from one drafter pass,
    verified in one target forward under an ancestor-only mask (see `dflash.eval.ddtree`).

    `budget` None: the drafter's chain (its argmax per position) is the tree. `lookup`: prompt
    lookup's continuation joins the tree as one more branch (up to B-1 nodes more), so a round
    accepts whichever of the two the target follows further, at no cost in exactness.
    """
    bsz = proposer.block_size
    extra = (budget or bsz - 1) + (bsz - 1 if lookup else 0) + 1
    first, pending, started = _start(target, proposer, prompt, max_new_tokens, extra, rule)
    setup = capture_seconds(target, proposer)
    committed = [*prompt, first]
    gen = Generation(tokens=[first])
    done = first in eos_ids or max_new_tokens <= 1
    while not done:
        room = max_new_tokens - len(gen.tokens)
        root = committed[-1]
        logits = proposer.draft_logits(committed, pending)
        if budget is None:
            tree = ddtree.chain_tree(root, logits.argmax(-1).tolist())
        else:
            tree = ddtree.build_tree(root, logits.float(), budget, topk)
        if lookup:
            tree = ddtree.with_path(tree, prompt_lookup_draft(committed, bsz - 1))
        prefix = len(committed) - 1
        verified, features = target.forward_tree(tree, prefix, rule.logits)
        path, bonus = rule.tree(tree, verified)
        target.keep_path(path, prefix)
        pending = features[torch.tensor([0, *path], device=features.device)]
        new, done = _stop(ddtree.accepted_tokens(tree, path, bonus), room, eos_ids)
        committed += new
        gen.tokens += new
        gen.accepted.append(len(new))
    _stop_clock(gen, target, proposer, started, setup)
    return gen
