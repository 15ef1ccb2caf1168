"""The target's and the drafter's decoding sessions: what a round's forwards run on.

Two target sessions share one interface: `StaticSession` (preallocated caches, fixed-shape steps,
CUDA graphs on GPU; `dflash.model.engine`) for the common decoder layouts, and `HFSession`
(transformers' DynamicCache) for any other causal LM. `DrafterSession` is the drafter over its
own preallocated context cache. `dflash.eval.decode` runs the rounds over them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dflash.eval import ddtree
from dflash.model.decoder import supports_static
from dflash.model.drafter import Drafter, layer_projections, layer_rest
from dflash.model.engine import StaticDrafterCache, StaticTarget
from dflash.model.fused import fused
from dflash.model.graphs import CudaGraphs


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
    def _run(self, tokens, logits: bool, **kwargs):
        ids = torch.tensor([tokens], device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **kwargs)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)[0]
        self._captured.clear()
        return out.logits[0] if logits else out.logits[0].argmax(-1), features

    def forward(self, tokens: list[int], logits: bool = False):
        """(argmax next token per row, features (rows, n*H)) of `tokens` after the cache; with
        `logits`, the next-token logits (rows, V) in place of the argmax."""
        return self._run(tokens, logits)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative count: the form every transformers
        version accepts; newer ones reject a positive length)."""
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)

    def forward_tree(self, tree: ddtree.DraftTree, prefix: int, logits: bool = False):
        """Verify every node of `tree` (root = the last committed token at `prefix`)."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return self._run(
            tree.tokens.tolist(),
            logits,
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

    def forward(self, tokens: list[int], logits: bool = False):
        ids = torch.tensor([tokens], device=self.device)
        n = len(tokens)
        positions = self._positions(n)
        span = attended(self.length + n, self.engine.capacity)
        if self.length == 0:  # the prompt: one eager forward of its own length
            out = self.engine.forward(
                ids, positions, positions[0], last_only=True, span=span, logits=logits
            )
        else:
            step = self._chain(span, logits)
            out = self.graphs(("chain", n, span, logits), step, ids, positions)
        self.length += n
        return out

    def _chain(self, span: int, logits: bool):
        def step(ids, positions):
            return self.engine.forward(ids, positions, positions[0], span=span, logits=logits)

        return step

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def forward_tree(self, tree: ddtree.DraftTree, prefix: int, logits: bool = False):
        assert prefix == self.length, "the tree's root follows the cached rows"
        n = tree.tokens.numel()
        span = attended(prefix + n, self.engine.capacity)
        # two copies to the GPU (tokens with positions, the nodes' ancestors); the (n, span)
        # mask is built inside the step, not on the host every round
        nodes = torch.stack([tree.tokens, ddtree.tree_positions(tree, prefix)]).to(self.device)
        ancestors = ddtree.tree_attention_mask(tree, 0).to(self.device)
        out = self.graphs(("tree", n, span, logits), self._tree(span, logits), nodes, ancestors)
        self.length = prefix + n
        return out

    def _tree(self, span: int, logits: bool):
        def step(nodes, ancestors):
            """Node i sees the cache rows before the root (its position `prefix`) and, among
            the tree's own rows prefix.., its ancestors and itself."""
            ids, positions = nodes[:1], nodes[1:]
            n, prefix = ids.shape[1], positions[0, :1]
            rows = torch.arange(span, device=ids.device)
            offset = rows - prefix  # a row's node, for the tree's rows
            in_tree = (offset >= 0) & (offset < n)
            tree = ancestors.gather(1, offset.clamp(0, n - 1).expand(n, span)) & in_tree
            mask = ((rows < prefix) | tree)[None, None]
            slots = prefix + torch.arange(n, device=ids.device)
            return self.engine.forward(ids, positions, slots, mask, span=span, logits=logits)

        return step

    def keep_path(self, path: list[int], prefix: int) -> None:
        if path:
            src = prefix + torch.tensor(path, device=self.device)
            dst = prefix + 1 + torch.arange(len(path), device=self.device)
            self.engine.move_rows(src, dst)
        self.length = prefix + 1 + len(path)


# A step attends over the cache rows up to its own last position, rounded up to whole spans of
# this many rows, not over the whole cache: a masked attention at batch size 1 reads every row it
# is given, so over the whole cache a round cost more in a process whose earlier, longer prompts
# had grown it (5.5 against 2.7 ms a round, BENCHMARKS.md 2026-12-04). One CUDA graph per step
# shape and span.
SPAN_ROWS = 256


def attended(rows: int, capacity: int) -> int:
    """The cache rows a step whose last position is `rows - 1` attends over."""
    return min(capacity, -(-rows // SPAN_ROWS) * SPAN_ROWS)


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
        span = attended(self.length, self.cache.capacity)
        if start == 0 or rows > bsz:  # the prompt: one eager call of its own length
            slots = start + torch.arange(rows, device=self.device)
            return self._step(block, features, slots, valid, span)[0]
        padded = features.new_zeros(bsz, features.shape[1])
        padded[:rows] = features
        slots = start + torch.arange(bsz, device=self.device)
        step = functools.partial(self._step, span=span, pieces=self.pieces)
        return self.graphs(("round", span), step, block, padded, slots, valid)[0]

    def _step(self, block, features, slots, valid, span: int, pieces=None):
        """Context rows go to cache rows `slots` (those at or past `valid` are padding); the
        block, at positions `valid`.., sees the cached rows below `valid` and itself, reading
        the cache's first `span` rows only."""
        bsz = block.shape[1]
        self.cache.slots, self.cache.span = slots, span
        visible = torch.cat(
            [
                torch.arange(span, device=self.device) < valid,
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
