"""A target decoder layer written out over its own Hugging Face modules (norms, projections,
rotary embedding, MLP), with the attention done here.

Why not call the layer: transformers' decoder forward builds its mask in `masking_utils`, whose
packed-sequence check reads a tensor on the host (`.all()`, a sync on every training step), and
its layer wrappers (checkpointing, deprecation shims on a ContextVar) break `torch.compile`'s
full graph. Written out, a whole-sequence causal layer is pure tensor work: equal to transformers'
own forward (bit for bit in fp32, `tests/test_target_features.py`), and one compiled graph serves
every layer of the target, since the layers differ only in their weights. The static decoding
engine (`dflash.model.engine`) uses the same pieces over its preallocated caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.rope import apply_rope

# Pre-norm decoders whose attention is q/k/v/o projections (+ optional q/k RMSNorm) with RoPE.
STATIC_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def static_layout(config) -> bool:
    """Whether a decoder of this config is one this module can write out (no sliding window)."""
    window = (
        getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True)
        else None
    )
    return config.model_type in STATIC_TYPES and window is None


def supports_static(model: nn.Module) -> bool:
    return static_layout(model.config)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qkv(attn: nn.Module, h: torch.Tensor, cos, sin, head_dim: int):
    """Queries, keys, values (b, heads, n, head_dim) of a decoder layer's normed input h (b, n, H),
    rotated to their positions, as the Hugging Face attention module computes them."""
    b, n = h.shape[:2]
    q = attn.q_proj(h).view(b, n, -1, head_dim)
    k = attn.k_proj(h).view(b, n, -1, head_dim)
    v = attn.v_proj(h).view(b, n, -1, head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v


def causal_layer(layer: nn.Module, x: torch.Tensor, cos, sin, head_dim: int):
    """One decoder layer over whole sequences x (b, n, H) at positions 0..n-1: (output, keys,
    values). Causal attention needs no mask for right-padded rows: a real token never sees a
    later (padding) position."""
    attn = layer.self_attn
    q, k, v = qkv(attn, layer.input_layernorm(x), cos, sin, head_dim)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True
    )
    b, n = x.shape[:2]
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    return x + mlp(layer, layer.post_attention_layernorm(x)), k, v


def mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The layer's MLP; a mixture-of-experts block may also return its router logits."""
    out = layer.mlp(h)
    return out[0] if isinstance(out, tuple) else out


def layer_output(layer: nn.Module, x: torch.Tensor, cos, sin, head_dim: int) -> torch.Tensor:
    """`causal_layer`'s output alone: what the feature model runs (and compiles) per layer."""
    return causal_layer(layer, x, cos, sin, head_dim)[0]
