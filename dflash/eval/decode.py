"""Greedy speculative decoding with a DFlash drafter, as a serving engine runs it (batch size 1).

Round: the last committed token x_n (the previous round's bonus, its features not computed yet)
is the anchor; the drafter reads the committed context's features (its own KV cache) and drafts
x_{n+1..n+B-1} in one pass; the target verifies `[x_n, drafts]` in one forward with its KV cache,
the longest prefix where draft == target argmax is accepted, plus the target's next token (bonus).
The target cache is cropped to the committed tokens, and the verified rows' features become the
drafter's new context. The same loop with no drafts is plain greedy decoding of the target, which
is what every output is checked against (lossless) and what speedups are measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash.model.drafter import Drafter, DrafterCache
from dflash.model.objective import full_attend


class TargetSession:
    """The full target with a KV cache, returning argmax tokens and the drafter's features."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.reset()
        self._captured: dict[int, torch.Tensor] = {}
        layers = model.get_decoder().layers
        self._hooks = [layers[i].register_forward_hook(self._capture(i)) for i in self.layer_ids]

    def _capture(self, i: int):
        def hook(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.no_grad()
    def forward(self, tokens: list[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax next token per row, features (rows, n*H)) for `tokens` after the cache."""
        device = self.model.get_input_embeddings().weight.device
        ids = torch.tensor([tokens], device=device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **kwargs)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)[0]
        self._captured.clear()
        return out.logits[0].argmax(-1), features

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative count: the form every transformers
        version accepts; newer ones reject a positive length)."""
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these cache positions (the accepted path of a verified tree)."""
        for layer in self.cache.layers:
            idx = rows.to(layer.keys.device)
            layer.keys = layer.keys[:, :, idx]
            layer.values = layer.values[:, :, idx]

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)


class DrafterSession:
    """The drafter with its context KV cache; drafts B-1 tokens after an anchor."""

    def __init__(self, drafter: Drafter, embed_tokens: nn.Module, head_weight: torch.Tensor):
        self.drafter, self.embed, self.head = drafter, embed_tokens, head_weight
        self.cache = DrafterCache()
        self.config = drafter.config

    @torch.no_grad()
    def draft_logits(self, anchor: int, features: torch.Tensor) -> torch.Tensor:
        """Logits (B-1, V) for the B-1 tokens after `anchor`, whose position follows the cached
        context plus the new committed `features` (rows, n*H) given here."""
        device = self.head.device
        start = len(self.cache)
        ctx_positions = torch.arange(start, start + features.shape[0], device=device)[None]
        anchor_pos = start + features.shape[0]
        bsz = self.config.block_size
        block = torch.full((1, bsz), self.config.mask_token_id, device=device)
        block[0, 0] = anchor
        positions = torch.arange(anchor_pos, anchor_pos + bsz, device=device)[None]
        dtype = next(self.drafter.parameters()).dtype
        hidden = self.drafter(
            self.embed(block).to(dtype),
            features[None].to(dtype),
            positions,
            ctx_positions,
            full_attend,
            cache=self.cache,
        )
        return hidden[0, 1:] @ self.head.to(dtype).T


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), cut at EOS / max_new_tokens
    accepted: list[int] = field(default_factory=list)  # per verify round: drafts accepted + 1
    seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)


class Proposer:
    """What drafts each round: nothing (target-only), the drafter, or prompt lookup."""

    block_size = 1

    def start(self, prompt: list[int], features: torch.Tensor) -> None:
        pass

    def propose(self, committed: list[int], features: torch.Tensor) -> list[int]:
        """Draft tokens to follow `committed` (whose last token is the anchor). `features` are
        the target features of committed tokens not yet reported (all but the anchor)."""
        return []


class DrafterProposer(Proposer):
    def __init__(self, drafter, embed_tokens, head_weight):
        self.parts = (drafter, embed_tokens, head_weight)
        self.block_size = drafter.config.block_size

    def start(self, prompt, features):
        self.session = DrafterSession(*self.parts)

    def propose(self, committed, features):
        return self.session.draft_logits(committed[-1], features).argmax(-1).tolist()


def generate(
    target: TargetSession,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
) -> Generation:
    """Greedy decoding of `prompt` with drafts from `proposer`, verified by `target`."""
    started = time.perf_counter()
    target.reset()
    next_tokens, features = target.forward(prompt)
    proposer.start(prompt, features)
    committed = list(prompt) + [int(next_tokens[-1])]
    pending = features  # committed rows whose features the drafter has not seen
    gen = Generation(tokens=[committed[-1]])
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in eos_ids:
        drafts = proposer.propose(committed, pending)
        drafts = drafts[: max_new_tokens - len(gen.tokens)]
        anchor_at = len(committed) - 1
        verified, features = target.forward([committed[-1], *drafts])
        n = 0
        while n < len(drafts) and drafts[n] == int(verified[n]):
            n += 1
        new = [*drafts[:n], int(verified[n])]
        target.crop(anchor_at + n + 1)  # keep the anchor and the accepted drafts
        pending = features[: n + 1]
        committed += new
        gen.tokens += new
        gen.accepted.append(n + 1)
    gen.tokens = _cut(gen.tokens, eos_ids, max_new_tokens)
    gen.seconds = time.perf_counter() - started
    return gen


def generate_tree(
    target: TargetSession,
    proposer: DrafterProposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    budget: int,
    topk: int,
) -> Generation:
    """DDTree: `generate` with a best-first tree of `budget` drafts from one drafter pass,
    verified in one target forward under an ancestor-only mask (see `dflash.eval.ddtree`)."""
    from dflash.eval import ddtree

    started = time.perf_counter()
    target.reset()
    next_tokens, features = target.forward(prompt)
    proposer.start(prompt, features)
    committed = list(prompt) + [int(next_tokens[-1])]
    pending = features
    gen = Generation(tokens=[committed[-1]])
    dtype = target.model.get_input_embeddings().weight.dtype
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in eos_ids:
        logits = proposer.session.draft_logits(committed[-1], pending)
        tree = ddtree.build_tree(committed[-1], logits.float(), budget, topk)
        prefix = len(committed) - 1
        device = features.device
        verified, features = target.forward(
            tree.tokens.tolist(),
            position_ids=ddtree.tree_positions(tree, prefix)[None].to(device),
            attention_mask=ddtree.hf_tree_mask(tree, prefix, dtype).to(device),
        )
        path, bonus = ddtree.walk(tree, verified.cpu())
        target.keep(ddtree.kept_cache_rows(path, prefix))
        pending = features[torch.tensor([0, *path], device=device)]
        new = ddtree.accepted_tokens(tree, path, bonus)
        committed += new
        gen.tokens += new
        gen.accepted.append(len(new))
    gen.tokens = _cut(gen.tokens, eos_ids, max_new_tokens)
    gen.seconds = time.perf_counter() - started
    return gen


def _cut(tokens: list[int], eos_ids: set[int], limit: int) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens[:limit]
