"""Fixed-shape decoding steps: preallocated KV caches, explicit positions and masks, CUDA graphs.

Batch-size-1 decoding of a small target is launch-bound: SmolLM2's 30 layers are ~450 kernel
launches per forward, ~20 ms eager on an H200 whatever the GPU's speed. Here every step after the
prompt has a fixed shape (1 token, the verified block, or the tree budget), the caches never move
(a rejected draft is dropped by moving the length back; its stale rows are masked and later
overwritten), and on CUDA each step shape is captured once as a CUDA graph and replayed (once per
span of cache rows it reads: `dflash.eval.sessions.attended`).

The target's decoder is run layer by layer from its own Hugging Face modules (norms, projections,
rotary embedding, MLP), with the attention written here over the static cache: transformers'
cache classes changed their interface between 5.17 and 5.24, and the tree mask needs exact
control of which cache rows each query sees (`dflash.model.decoder` holds the pieces).
Architectures with that standard layout are listed in `STATIC_TYPES` there; others decode
through transformers' own cache (`dflash.eval.decode`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.decoder import head_dim, supports_static
from dflash.model.fused import StepPieces
from dflash.model.graphs import CudaGraphs, PendingTokens  # noqa: F401  (CudaGraphs: for dflash.eval)

log = logging.getLogger(__name__)


class StaticTarget:
    """The target's forward over a preallocated KV cache of `capacity` rows.

    `forward(ids, positions, slots, mask)` writes the keys/values of `ids` into cache rows `slots`
    and lets query i see the rows where `mask[..., i, :]` is True (None: the causal rule
    row <= position, for steps whose rows equal their positions). Pure tensor work, no host sync:
    safe to capture in a CUDA graph.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], capacity: int):
        if not supports_static(model):
            raise ValueError(f"model type {model.config.model_type!r} has no static decoder here")
        self.model, self.layer_ids = model, sorted(layer_ids)
        self.decoder = model.get_decoder()
        config = model.config
        self.head_dim = head_dim(config)
        weight = model.get_input_embeddings().weight
        # every layer's keys and values in one tensor (2, layers, 1, heads, rows, dim), so that
        # moving a verified tree path's rows is one gather and one copy for the whole model, not
        # two per layer and cache (60 each for SmolLM2's 30 layers, eager, every round)
        n = len(self.decoder.layers)
        shape = (2, n, 1, config.num_key_value_heads, capacity, self.head_dim)
        self.cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.keys, self.values = list(self.cache[0]), list(self.cache[1])
        self.capacity = capacity
        self.rows = torch.arange(capacity, device=weight.device)
        self.pieces = StepPieces(weight.device)
        self.eager = StepPieces(weight.device, compiled=False)

    @torch.no_grad()
    def forward(
        self, ids, positions, slots, mask=None, last_only: bool = False, span=None, logits=False
    ):
        """(argmax next token per query (q,), features (q, n*H)) of ids (1, q), or with `logits`
        the next-token logits (q, V) in place of the argmax (sampling decides outside); with
        `last_only` the LM head runs on the last query alone (a prompt: q x vocab logits of a
        long one would take gigabytes). The queries read the cache's first `span` rows (None:
        all); a `mask` is (1, 1, q, span)."""
        span = span or self.capacity
        if mask is None:
            mask = (self.rows[None, :span] <= positions[0][:, None])[None, None]
        x = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(x, positions)
        features = []
        q_len = ids.shape[1]
        # a prompt (`last_only`) has a length of its own each time: compiling it would trace
        # every length, so it runs eagerly, once a sequence
        pieces = self.eager if last_only else self.pieces
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            q, k, v = pieces.projections(layer, x, cos, sin, self.head_dim)
            self.keys[i].index_copy_(2, slots, k)
            self.values[i].index_copy_(2, slots, v)
            keys, values = self.keys[i][:, :, :span], self.values[i][:, :, :span]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True
            )
            x = pieces.mlp(layer, x, out.transpose(1, 2).reshape(1, q_len, -1))
            if i in self.layer_ids:
                features.append(x)
        out = self.model.lm_head(self.decoder.norm(x[:, -1:] if last_only else x))[0]
        return out if logits else out.argmax(-1), torch.cat(features, dim=-1)[0]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache rows `src` to rows `dst` in every layer (a verified tree's accepted path)."""
        self.cache.index_copy_(4, dst, self.cache.index_select(4, src))


class StaticDrafterCache:
    """The drafter's context keys/values in preallocated rows; `slots` says where the next
    context rows go and `span` how many of the first rows the block reads (both set before each
    call). Rows past the valid length are masked by the caller."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.slots: torch.Tensor | None = None
        self.span = capacity

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer == len(self.kv):
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self.kv.append((k.new_zeros(shape), v.new_zeros(shape)))
        keys, values = self.kv[layer]
        keys.index_copy_(2, self.slots, k)
        values.index_copy_(2, self.slots, v)
        return keys[:, :, : self.span], values[:, :, : self.span]
