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

Two target sessions share one interface: `StaticSession` (preallocated caches, fixed-shape steps,
CUDA graphs on GPU; `dflash.model.engine`) for the common decoder layouts, and `HFSession`
(transformers' DynamicCache) for any other causal LM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash.eval import ddtree
from dflash.eval.lookup import prompt_lookup_draft
from dflash.model.decoder import supports_static
from dflash.model.drafter import Drafter, layer_projections, layer_rest
from dflash.model.engine import StaticDrafterCache, StaticTarget
from dflash.model.fused import fused
from dflash.model.graphs import CudaGraphs, capture_seconds


def _device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


class HFSession:
    """The target with transformers' DynamicCache; argmax tokens and the drafter's features."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.device = _device(model)
        self._captured: dict[int, torch.Tensor] = {}
        layers = model.get_decoder().layers
        self._hooks = [layers[i].register_forward_hook(self._capture(i)) for i in self.layer_ids]
        self.reset()

    def _capture(self, i: int):
        def hook(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def reset(self, capacity: int = 0) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.no_grad()
    def _run(self, tokens, **kwargs):
        ids = torch.tensor([tokens], device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **kwargs)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)[0]
        self._captured.clear()
        return out.logits[0].argmax(-1), features

    def forward(self, tokens: list[int]):
        """(argmax next token per row, features (rows, n*H)) of `tokens` after the cache."""
        return self._run(tokens)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative count: the form every transformers
        version accepts; newer ones reject a positive length)."""
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)

    def forward_tree(self, tree: ddtree.DraftTree, prefix: int):
        """Verify every node of `tree` (root = the last committed token at `prefix`)."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return self._run(
            tree.tokens.tolist(),
            position_ids=ddtree.tree_positions(tree, prefix)[None].to(self.device),
            attention_mask=ddtree.hf_tree_mask(tree, prefix, dtype).to(self.device),
        )

    def keep_path(self, path: list[int], prefix: int) -> None:
        """Keep the prefix, the root and the accepted nodes' cache rows, in order."""
        rows = ddtree.kept_cache_rows(path, prefix)
        for layer in self.cache.layers:
            idx = rows.to(layer.keys.device)
            layer.keys = layer.keys[:, :, idx]
            layer.values = layer.values[:, :, idx]


class StaticSession:
    """The target over a preallocated cache (`StaticTarget`); decode steps replay CUDA graphs."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.device = _device(model)
        self.graphs = CudaGraphs(self.device)
        self.engine: StaticTarget | None = None
        self.length = 0

    def reset(self, capacity: int) -> None:
        """Start a sequence that will need at most `capacity` cache rows."""
        if self.engine is None or self.engine.capacity < capacity:
            capacity = _grown(capacity, self.engine.capacity if self.engine else 0)
            self.engine = None
            self.graphs.clear()
            self.engine = StaticTarget(self.model, self.layer_ids, capacity)
        self.length = 0

    def _positions(self, n: int) -> torch.Tensor:
        return torch.arange(self.length, self.length + n, device=self.device)[None]

    def forward(self, tokens: list[int]):
        ids = torch.tensor([tokens], device=self.device)
        positions = self._positions(len(tokens))
        if self.length == 0:  # the prompt: one eager forward of its own length
            out = self.engine.forward(ids, positions, positions[0], last_only=True)
        else:
            out = self.graphs(("chain", len(tokens)), self._chain, ids, positions)
        self.length += len(tokens)
        return out

    def _chain(self, ids, positions):
        return self.engine.forward(ids, positions, positions[0])

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def forward_tree(self, tree: ddtree.DraftTree, prefix: int):
        assert prefix == self.length, "the tree's root follows the cached rows"
        n = tree.tokens.numel()
        mask = torch.zeros(n, self.engine.capacity, dtype=torch.bool)
        mask[:, : prefix + n] = ddtree.tree_attention_mask(tree, prefix)
        ids = tree.tokens[None].to(self.device)
        positions = ddtree.tree_positions(tree, prefix)[None].to(self.device)
        slots = self._positions(n)[0]
        mask = mask[None, None].to(self.device)
        out = self.graphs(("tree", n), self.engine.forward, ids, positions, slots, mask)
        self.length = prefix + n
        return out

    def keep_path(self, path: list[int], prefix: int) -> None:
        if path:
            src = prefix + torch.tensor(path, device=self.device)
            dst = prefix + 1 + torch.arange(len(path), device=self.device)
            self.engine.move_rows(src, dst)
        self.length = prefix + 1 + len(path)


def _grown(needed: int, current: int) -> int:
    """A new cache size: at least double the old one, in steps of 256 rows, so that a run of
    ever longer prompts reallocates (and recaptures its graphs) only a few times."""
    return max(-(-needed // 256) * 256, 2 * current)


def target_session(model: nn.Module, layer_ids: list[int]) -> StaticSession | HFSession:
    """The fast static session where the architecture allows, transformers' cache otherwise."""
    return (
        StaticSession(model, layer_ids) if supports_static(model) else HFSession(model, layer_ids)
    )


class DrafterSession:
    """The drafter with a preallocated context KV cache; drafts B-1 tokens after an anchor.

    The prompt's context rows go in with one eager call; every later round pads its new context
    rows (accepted tokens + the anchor's predecessor, at most B) to B, so all rounds have one
    shape and replay one CUDA graph on GPU.
    """

    def __init__(self, drafter: Drafter, embed_tokens, head_weight):
        self.drafter, self.embed, self.head = drafter, embed_tokens, head_weight
        self.config = drafter.config
        self.device = head_weight.device
        self.dtype = next(drafter.parameters()).dtype
        self.graphs = CudaGraphs(self.device)
        # each layer's halves around its cache and attention, fused on CUDA (as the target's)
        self.pieces = (fused(layer_projections, self.device), fused(layer_rest, self.device))
        self.cache: StaticDrafterCache | None = None
        self.length = 0

    def reset(self, capacity: int) -> None:
        """Start a sequence of at most `capacity` context rows."""
        capacity += self.config.block_size  # room for the last round's padding rows
        if self.cache is None or self.cache.capacity < capacity:
            self.graphs.clear()
            self.cache = StaticDrafterCache(
                _grown(capacity, self.cache.capacity if self.cache else 0)
            )
        self.length = 0

    @torch.no_grad()
    def draft_logits(self, anchor: int, features: torch.Tensor) -> torch.Tensor:
        """Logits (B-1, V) for the B-1 tokens after `anchor`, whose position follows the cached
        context plus the new committed `features` (rows, n*H) given here."""
        bsz = self.config.block_size
        rows = features.shape[0]
        block = torch.full((1, bsz), self.config.mask_token_id, device=self.device)
        block[0, 0] = anchor
        start = self.length
        self.length += rows
        valid = torch.tensor([self.length], device=self.device)
        if start == 0 or rows > bsz:  # the prompt: one eager call of its own length
            slots = start + torch.arange(rows, device=self.device)
            return self._step(block, features, slots, valid)[0]
        padded = features.new_zeros(bsz, features.shape[1])
        padded[:rows] = features
        slots = start + torch.arange(bsz, device=self.device)
        return self.graphs("round", self._round, block, padded, slots, valid)[0]

    def _round(self, block, features, slots, valid):
        return self._step(block, features, slots, valid, pieces=self.pieces)

    def _step(self, block, features, slots, valid, pieces=None):
        """Context rows go to cache rows `slots` (those at or past `valid` are padding); the
        block, at positions `valid`.., sees the cached rows below `valid` and itself."""
        bsz = block.shape[1]
        self.cache.slots = slots
        visible = torch.cat(
            [
                torch.arange(self.cache.capacity, device=self.device) < valid,
                torch.ones(bsz, dtype=torch.bool, device=self.device),
            ]
        )[None, None, None]

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

        hidden = self.drafter(
            self.embed(block).to(self.dtype),
            features[None].to(self.dtype),
            (valid + torch.arange(bsz, device=self.device))[None],
            slots[None],
            attend,
            cache=self.cache,
            pieces=pieces,
        )
        return (hidden[0, 1:] @ self.head.to(self.dtype).T,)


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
