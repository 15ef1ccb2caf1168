"""Batched decoding for regeneration: `batch` independent sequences over one preallocated KV
cache, rows refilled as they finish, every step one fixed shape (CUDA graphs on GPU). The
single-sequence steps of the evaluation are `dflash.model.engine`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.decoder import causal_layer, head_dim, supports_static
from dflash.model.fused import StepPieces
from dflash.model.graphs import CudaGraphs, PendingTokens
from dflash.model.sampling import Sampling, keyed_sample

# Cache rows per flex_attention key block: the decode step reads only the blocks up to each
# row's own position, instead of the whole cache under a mask.
KV_BLOCK = 128


def aligned(n: int) -> int:
    """`n` rounded up to whole key blocks."""
    return -(-n // KV_BLOCK) * KV_BLOCK


def live_blocks(positions: torch.Tensor, capacity: int, queries: int):
    """A flex_attention BlockMask for `queries` queries per row (the query heads of one key
    head): row b sees cache rows 0..positions[b], the blocks past it are never read. Tensor work
    only (it runs inside the step's CUDA graph)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, n_blocks = positions.shape[0], capacity // KV_BLOCK
    counts = (positions // KV_BLOCK + 1).to(torch.int32).view(batch, 1, 1)
    order = torch.arange(n_blocks, dtype=torch.int32, device=positions.device)
    indices = order.view(1, 1, 1, n_blocks).expand(batch, 1, 1, n_blocks).contiguous()

    def visible(b, h, q, kv):
        return kv <= positions[b]

    return BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=(KV_BLOCK, KV_BLOCK), mask_mod=visible,
        seq_lengths=(queries, capacity), compute_q_blocks=False,  # those serve a backward only
    )  # fmt: skip


class BatchedGreedy:
    """Greedy (or keyed sampling) decoding of `batch` independent sequences over one
    preallocated KV cache.

    `prefill(rows, prompts)` puts sequences into free rows and returns their first tokens;
    `step()` advances every row by one token. A row's tokens depend only on its own prompt: every
    step and every prefill has one shape, and where a prompt sits in a prefill call does not
    change its arithmetic. Rows can therefore be refilled as they finish (no waiting for the
    batch's longest), and a resumed regeneration produces the same tokens as an uninterrupted
    one. On CUDA both replay CUDA graphs.

    `attention`: `sdpa` attends over the whole cache under a mask (its cost grows with the
    capacity, whatever the rows' lengths), and a prefill takes `prefill_rows` prompts, each
    padded to `prompt_width` after its end (causal attention never sees the padding). `flex`
    reads only the key blocks up to each row's position (compiled flex_attention; the capacity
    is rounded up to whole blocks), and a prefill packs prompts end to end into one sequence of
    `PREFILL_TOKENS`, each starting on a key block (so its blocks are those it would have alone)
    and seeing only its own: padding is at most a block a prompt, not up to the tier's width.
    Unused prefill rows and tokens write to a scratch cache row no sequence reads.

    `sampling` above temperature 0 draws each token with `keyed_sample`: from the row's key
    (given at its prefill) and the token's position, inside the step's graph, so a row's tokens
    still depend only on its own prompt and key.
    """

    # Tokens per prefill call: one prompt at a time cost ~5 ms whatever its length (30 layers of
    # small launches), which multi-turn data pays for every turn; 8K tokens per call keeps the
    # GEMMs full and the padding's extra compute small.
    PREFILL_TOKENS = 8192

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        capacity: int,
        prompt_width: int,
        attention: str = "sdpa",
        compiled: bool | None = None,
        sampling: Sampling | None = None,
    ):
        if not supports_static(model):
            raise ValueError(f"model type {model.config.model_type!r} has no static decoder here")
        if prompt_width >= capacity:
            raise ValueError(f"prompt_width {prompt_width} leaves no room in capacity {capacity}")
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be sdpa or flex, not {attention!r}")
        self.attention = attention
        self.packed = attention == "flex"
        if self.packed:
            from torch.nn.attention.flex_attention import flex_attention

            capacity = -(-capacity // KV_BLOCK) * KV_BLOCK
            self.flex = torch.compile(flex_attention, dynamic=False)
            self.pack_tokens = max(self.PREFILL_TOKENS, aligned(prompt_width))
            self.prefill_rows = min(batch, self.pack_tokens // KV_BLOCK)
        else:
            self.prefill_rows = max(1, min(batch, self.PREFILL_TOKENS // prompt_width))
        self.model, self.decoder = model, model.get_decoder()
        self.batch, self.capacity, self.prompt_width = batch, capacity, prompt_width
        self.head_dim = head_dim(model.config)
        config = model.config
        self.query_heads_per_key = config.num_attention_heads // config.num_key_value_heads
        weight = model.get_input_embeddings().weight
        self.device = weight.device
        # row `batch` is the scratch row unused prefill rows write to
        shape = (batch + 1, model.config.num_key_value_heads, capacity, self.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in self.decoder.layers]
        self.values = [weight.new_zeros(shape) for _ in self.decoder.layers]
        self.cache_rows = torch.arange(capacity, device=self.device)
        self.batch_rows = torch.arange(batch, device=self.device)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.sampling = sampling or Sampling()
        self.streams = torch.zeros(batch, dtype=torch.long, device=self.device)  # each row's key
        self.graphs = CudaGraphs(self.device)
        self.pieces = StepPieces(self.device, compiled)
        # two page-locked buffers, so a step's tokens copy to the host while the next one runs
        pinned = self.device.type == "cuda"
        self.host_tokens = [torch.empty(batch, dtype=torch.long, pin_memory=pinned) for _ in "ab"]
        self.launched = 0

    def prefill_count(self, lengths: list[int]) -> int:
        """How many of the prompts of these lengths, from the first, one prefill call takes."""
        if not self.packed:
            return min(self.prefill_rows, len(lengths))
        count = used = 0
        for n in lengths[: self.prefill_rows]:
            used += aligned(n)
            if used > self.pack_tokens:
                break
            count += 1
        return count

    def prefill(
        self, rows: list[int], prompts: list[list[int]], keys: list[int] | None = None
    ) -> list[int]:
        """Start `prompts` (at most `prefill_count` of them, each at most `prompt_width` tokens)
        in the free cache `rows`, each with its stream's key (sampling); returns their first
        tokens."""
        k, lengths_given = self.prefill_rows, list(map(len, prompts))
        if len(rows) != len(prompts) or not 0 < len(prompts) <= self.prefill_count(lengths_given):
            raise ValueError(f"prefill takes 1 to {k} prompts that fit one call, a row each")
        if max(lengths_given) > self.prompt_width:
            raise ValueError(f"a prompt is over prompt_width {self.prompt_width}")
        lengths = torch.ones(k, dtype=torch.long)
        targets = torch.full((k,), self.batch, dtype=torch.long)
        lengths[: len(prompts)] = torch.tensor(lengths_given)
        targets[: len(rows)] = torch.tensor(rows)
        streams = torch.zeros(k, dtype=torch.long)
        streams[: len(prompts)] = torch.tensor(keys or [0] * len(prompts))
        if self.packed:
            inputs = (*self._pack(prompts), targets, streams)
            fn = self._prefill_packed
        else:
            ids = torch.zeros(k, self.prompt_width, dtype=torch.long)
            for i, prompt in enumerate(prompts):
                ids[i, : len(prompt)] = torch.tensor(prompt)
            inputs, fn = (ids, lengths, targets, streams), self._prefill
        inputs = tuple(t.to(self.device) for t in inputs)
        (first,) = self.graphs(("prefill",), fn, *inputs)
        m, targets, lengths = len(prompts), targets.to(self.device), lengths.to(self.device)
        self.streams[targets[:m]] = inputs[-1][:m]
        self.tokens[targets[:m]] = first[:m]
        self.positions[targets[:m]] = lengths[:m]
        return first[:m].tolist()

    def _pack(self, prompts: list[list[int]]):
        """The packed call's inputs: token ids (1, T), each token's position in its prompt and
        its cache row (T,), each query block's first key block (T / KV_BLOCK,), each prompt's
        last token (prefill_rows,). Tokens past a prompt's end, to its next block, and the pack's
        unused tail keep counting positions and write to the scratch row."""
        total = self.pack_tokens
        ids = torch.zeros(1, total, dtype=torch.long)
        positions = torch.arange(total) % KV_BLOCK
        owners = torch.full((total,), self.prefill_rows, dtype=torch.long)  # the scratch row
        first_block = torch.arange(total // KV_BLOCK)
        last = torch.zeros(self.prefill_rows, dtype=torch.long)
        start = 0
        for i, prompt in enumerate(prompts):
            n, span = len(prompt), aligned(len(prompt))
            ids[0, start : start + n] = torch.tensor(prompt)
            positions[start : start + span] = torch.arange(span)
            owners[start : start + n] = i  # the prompt's index, mapped to its row on the device
            first_block[start // KV_BLOCK : (start + span) // KV_BLOCK] = start // KV_BLOCK
            last[i] = start + n - 1
            start += span
        return ids, positions, owners, first_block, last

    def step(self) -> list[int]:
        """The next token of every row (rows without a sequence produce garbage, ignored)."""
        return self.launch_step().get()

    def release(self, rows: list[int]) -> None:
        """Send finished rows back to position 0 until they are refilled: their (ignored) steps
        then read the cache's first key blocks under flex, not past their old sequence. No host
        sync (the indices go through page-locked memory), so it can follow a launched step."""
        index = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory()
        self.positions[index.to(self.device, non_blocking=True)] = 0

    def launch_step(self) -> PendingTokens:
        """`step` without waiting for it: the device advances every row (its next input stays
        on the device) while the host goes on; at most two launched steps may be unread."""
        (tokens,) = self.graphs(("step",), self._step, self.tokens, self.positions)
        self.tokens.copy_(tokens)
        self.positions.add_(1).clamp_(max=self.capacity - 1)  # idle rows must stay in bounds
        host = self.host_tokens[self.launched % 2]
        self.launched += 1
        host.copy_(tokens, non_blocking=True)
        return PendingTokens(host, self.device)

    @torch.no_grad()
    def _prefill(self, ids, lengths, targets, keys):
        k, width = ids.shape
        positions = self.cache_rows[None, :width]
        x = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(x, positions)
        for i, layer in enumerate(self.decoder.layers):
            x, key, v = causal_layer(layer, x, cos, sin, self.head_dim)
            self.keys[i][:, :, :width].index_copy_(0, targets, key)
            self.values[i][:, :, :width].index_copy_(0, targets, v)
        last = x[torch.arange(k, device=x.device), lengths - 1]
        return (
            keyed_sample(self.model.lm_head(self.decoder.norm(last)), self.sampling, keys, lengths),
        )

    @torch.no_grad()
    def _prefill_packed(self, ids, positions, owners, first_block, last, targets, keys):
        """A packed prefill (`_pack`): each query block sees the key blocks from its prompt's
        first to itself, causally; keys and values go to each token's row at its position."""
        from torch.nn.attention.flex_attention import BlockMask

        total = ids.shape[1]
        n_blocks = total // KV_BLOCK
        order = torch.arange(n_blocks, device=ids.device)
        counts = (order - first_block + 1).to(torch.int32).view(1, 1, n_blocks)
        # query block j reads key blocks first_block[j], first_block[j] + 1, ..., j (clamped
        # indices past the count are never read)
        indices = (first_block[:, None] + order[None]).clamp(max=n_blocks - 1)
        indices = indices.to(torch.int32).view(1, 1, n_blocks, n_blocks)

        def causal(b, h, q, kv):
            return kv <= q

        mask = BlockMask.from_kv_blocks(
            counts, indices, BLOCK_SIZE=(KV_BLOCK, KV_BLOCK), mask_mod=causal,
            seq_lengths=(total, total), compute_q_blocks=False,
        )  # fmt: skip
        # a token's cache row: its prompt's row, or the scratch row past the rows (`batch`)
        scratch = targets.new_full((1,), self.batch)
        rows = torch.cat([targets, scratch])[owners]
        x = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(x, positions[None])
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            q, k, v = self.pieces.projections(layer, x, cos, sin, self.head_dim)
            self.keys[i][rows, :, positions] = k[0].transpose(0, 1)
            self.values[i][rows, :, positions] = v[0].transpose(0, 1)
            out = self.flex(q, k, v, block_mask=mask, scale=attn.scaling, enable_gqa=True)
            x = self.pieces.mlp(layer, x, out.transpose(1, 2).reshape(1, total, -1))
        logits = self.model.lm_head(self.decoder.norm(x[0, last]))
        return (keyed_sample(logits, self.sampling, keys, positions[last] + 1),)

    @torch.no_grad()
    def _step(self, tokens, positions):
        x = self.decoder.embed_tokens(tokens[:, None])
        cos, sin = self.decoder.rotary_emb(x, positions[:, None])
        # each row sees its own cache rows up to its position; later rows are a previous
        # sequence's leftovers
        groups = self.query_heads_per_key
        if self.attention == "flex":
            blocks = live_blocks(positions, self.capacity, groups)
        else:
            mask = (self.cache_rows[None] <= positions[:, None])[:, None, None]
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            q, k, v = self.pieces.projections(layer, x, cos, sin, self.head_dim)
            self.keys[i][self.batch_rows, :, positions] = k[:, :, 0]
            self.values[i][self.batch_rows, :, positions] = v[:, :, 0]
            keys, values = self.keys[i][: self.batch], self.values[i][: self.batch]
            # one query per row: fold the query heads sharing a key head into the query axis,
            # so grouped-query attention reads the cache once instead of per head (and flex
            # uses its decoding kernel, which takes no GQA ratio other than a power of two)
            grouped = q.reshape(self.batch, k.shape[1], groups, self.head_dim)
            if self.attention == "flex":
                out = self.flex(grouped, keys, values, block_mask=blocks, scale=attn.scaling)
            else:
                out = F.scaled_dot_product_attention(
                    grouped, keys, values, attn_mask=mask, scale=attn.scaling
                )
            x = self.pieces.mlp(layer, x, out.reshape(self.batch, 1, -1))
        logits = self.model.lm_head(self.decoder.norm(x))[:, 0]
        return (keyed_sample(logits, self.sampling, self.streams, positions + 1),)
