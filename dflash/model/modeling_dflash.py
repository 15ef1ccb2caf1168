"""The DFlash drafter as a transformers model, shipped inside every exported drafter directory (as
`dflash.py`, named by config.json's `auto_map`), so that

    AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)

builds this class and not a plain Qwen3 model. It imports only torch and transformers: it must
run where the `dflash` package is not installed. Parameter names are those of
`dflash.model.drafter.Drafter` (tests/test_drafter.py checks both forwards agree).

One call drafts one block: queries come from the block's embeddings (the anchor token, then mask
tokens), keys and values from `[fc(target features of the context); block]`, with q/k RMSNorm
and RoPE on the true positions; the block sees the whole context and itself (non-causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
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
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps)

    def forward(self, x, ctx, rope_q, rope_kv, attention_mask):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_kv)
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
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attention_mask)
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
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.fc = nn.Linear(
            len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None):
        """Final hidden states (b, q, H) of the block; the target's LM head turns them into
        draft logits (the first row belongs to the anchor, the rest are the drafts).

        noise_embedding: (b, q, H) the target's embeddings of `[anchor, mask, ..., mask]`;
        target_hidden: (b, s, n*H) the context's hidden states from `target_layer_ids`
        (each layer's output), concatenated; position_ids: (b, s + q) the context's positions,
        then the block's; attention_mask: optional boolean (b, 1, q, s + q), True = attend
        (default: the block sees the whole context and itself).
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q_len = x.shape[1]
        rope_q, rope_kv = (cos[:, -q_len:], sin[:, -q_len:]), (cos, sin)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attention_mask)
        return self.norm(x)
