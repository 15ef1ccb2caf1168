"""The DFlash drafter as a transformers model, shipped inside every exported drafter directory (as
`dflash.py`, named by config.json's `auto_map`), so that

    AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)

builds this class and not a plain Qwen3 model. It imports only torch and transformers: it must
run where the `dflash` package is not installed. Parameter names are those of
`dflash.model.drafter.Drafter` (tests/test_drafter.py checks both forwards agree).

One call drafts one block: queries come from the block's embeddings (the anchor token, then mask
tokens), keys and values from `[fc(target features of the context); block]`, with q/k RMSNorm
and RoPE on the true positions; the block sees the whole context and itself (non-causal).

`spec_generate` decodes with a target as the public reference class does (same arguments, same
output), round for round the loop of `dflash.eval.decode.generate`, so the reference's usage
runs on our drafter (tests/test_reference_client.py checks the tokens against the evaluation's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x, cos, sin):
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps)

    def forward(self, x, ctx, rope_q, rope_kv, attention_mask, cache=None):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_kv)
        if cache is not None:  # earlier context rows; the caller crops the block's rows away
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attention_mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """Drafter layers over the target's features; the embedding and LM head are the target's."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.block_size = config.block_size
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.fc = nn.Linear(
            len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        noise_embedding,
        target_hidden,
        position_ids,
        attention_mask=None,
        past_key_values=None,
        **kwargs,
    ):
        """Final hidden states (b, q, H) of the block; the target's LM head turns them into
        draft logits (the first row belongs to the anchor, the rest are the drafts).

        noise_embedding: (b, q, H) the target's embeddings of `[anchor, mask, ..., mask]`;
        target_hidden: (b, s, n*H) the context's hidden states from `target_layer_ids`
        (each layer's output), concatenated; position_ids: (b, s + q) the context's positions,
        then the block's; attention_mask: optional boolean (b, 1, q, s + q), True = attend
        (default: the block sees the whole context and itself). past_key_values: a transformers
        Cache holding the keys/values of earlier context rows (then `target_hidden` holds only
        the new ones); it also receives the block's rows, which the caller crops away.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q_len = x.shape[1]
        rope_q, rope_kv = (cos[:, -q_len:], sin[:, -q_len:]), (cos, sin)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attention_mask, past_key_values)
        return self.norm(x)

    def compute_logits(self, hidden, output_head):
        """Draft logits from the target's LM head (the drafter has none of its own)."""
        return output_head(hidden.to(output_head.weight.dtype))

    def _features(self, out):
        # hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1]
        return torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target,
        input_ids,
        max_new_tokens,
        stop_token_ids=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        mask_token_id=None,
    ):
        """Speculative decoding of one prompt with `target` (a transformers causal LM): the
        prompt and the generated tokens, (1, n), ending at a stop token or after
        `max_new_tokens`. Greedy at temperature 0, where the output is the target's own greedy
        output; otherwise speculative sampling, which keeps the target's distribution.
        `self.acceptance_lengths` then holds the tokens committed per verify round."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt; got {input_ids.shape[0]}")
        warp = _warpers(temperature, top_p, top_k)
        mask = self.mask_token_id if mask_token_id is None else mask_token_id
        stops, device = set(stop_token_ids or []), input_ids.device
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        out = target(
            input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True
        )
        context = self._features(out)  # features of committed tokens the drafter has not read
        tokens = input_ids[0].tolist()
        prompt_len = len(tokens)
        tokens.append(int(_pick(out.logits[0, -1:], warp)[0]))
        self.acceptance_lengths = []
        done = tokens[-1] in stops or max_new_tokens <= 1
        while not done:
            room = max_new_tokens - (len(tokens) - prompt_len)
            anchor_at = len(tokens) - 1
            block = torch.full((1, self.block_size), mask, device=device)
            block[0, 0] = tokens[-1]
            positions = torch.arange(anchor_at - context.shape[1], anchor_at + self.block_size)
            hidden = self(
                embed(block).to(self.dtype),
                context.to(self.dtype),
                positions[None].to(device),
                past_key_values=draft_cache,
            )
            _crop(draft_cache, anchor_at)  # keep the context rows, not the block's
            logits = self.compute_logits(hidden[:, 1:], head)[0, :room]
            drafts = _pick(logits, warp)
            verify = torch.cat([block[0, :1], drafts])[None]
            out = target(
                verify, past_key_values=target_cache, use_cache=True, output_hidden_states=True
            )
            accepted, bonus = _accept(drafts, logits, out.logits[0], warp)
            new, done = _until_stop([*drafts[:accepted].tolist(), bonus], room, stops)
            _crop(target_cache, anchor_at + len(new))  # the anchor and the accepted drafts
            context = self._features(out)[:, : accepted + 1]
            tokens += new
            self.acceptance_lengths.append(len(new))
        return torch.tensor([tokens], device=device)


def _warpers(temperature, top_p, top_k):
    """transformers' sampling warpers, or None for greedy decoding."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"spec_generate: temperature must be >= 0 (got {temperature}), top_p in (0, 1] "
            f"(got {top_p}) and top_k >= 0 (got {top_k})"
        )
    if temperature == 0:
        return None
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    return LogitsProcessorList(warpers)


def _probs(logits, warp):
    return torch.softmax(warp(None, logits.float()), dim=-1)


def _pick(logits, warp):
    """One token per row of `logits`: the argmax, or a sample of the warped distribution."""
    if warp is None:
        return logits.argmax(-1)
    return torch.multinomial(_probs(logits, warp), 1)[:, 0]


def _accept(drafts, draft_logits, target_logits, warp):
    """(drafts accepted, the target's token after them). Greedy: the longest prefix equal to
    the target's argmax. Sampling: draft i stays with probability min(1, p/q); the first one
    rejected is replaced by a sample of max(p - q, 0), as speculative sampling does."""
    if warp is None:
        best = target_logits.argmax(-1)
        n = int((drafts == best[: len(drafts)]).long().cumprod(0).sum())
        return n, int(best[n])
    p, q = _probs(target_logits, warp), _probs(draft_logits, warp)
    for i, d in enumerate(drafts.tolist()):
        if torch.rand(()) * q[i, d] >= p[i, d]:
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(residual, 1))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1))


def _until_stop(new, room, stops):
    """The tokens of a round really committed: none past the limit, none after a stop token."""
    new = new[:room]
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1], True
    return new, len(new) == room


def _crop(cache, length):
    # a negative count: the form every transformers version accepts
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())
