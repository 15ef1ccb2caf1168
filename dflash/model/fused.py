"""Decode steps' layers fused by torch.compile around their caches and attention.

A decode step runs one layer after another at a fixed shape; eagerly each layer is dozens of
small kernels (norms, RoPE, residuals), and on an H200 their launch gaps cost more than the
matrix products at batch 1. Each function here is one half of a layer, before or after the
attention; `fused` compiles it once for the process, so one graph serves every layer (the weights
are inputs to it) and every engine. The caches and the attention stay outside the graphs, which
therefore never mutate a cache.
"""

from __future__ import annotations

import os

import torch

from dflash.model.decoder import mlp, qkv


def step_projections(layer, x, cos, sin, head_dim: int):
    """A decode step's layer, before attention: the normed input's rotated queries, keys and
    values."""
    return qkv(layer.self_attn, layer.input_layernorm(x), cos, sin, head_dim)


def step_mlp(layer, x, attended):
    """A decode step's layer, after attention: the output projection, the residuals, the MLP."""
    x = x + layer.self_attn.o_proj(attended)
    return x + mlp(layer, layer.post_attention_layernorm(x))


class StepPieces:
    """The two halves of a decode step's layer around its attention, compiled on CUDA.

    Eagerly, a Qwen3-8B decode step is ~2,000 small kernels (each RMSNorm alone is seven, RoPE
    five a tensor), and even replayed as a CUDA graph their launch gaps cost more than reading
    the weights: 8.7 ms a token at batch 1 against 3.2 ms of bandwidth (6.1 ms fused, H200,
    BENCHMARKS.md 2026-12-03 "the decode step fused"). Compiled, each half fuses
    its pointwise work around the matrix products. The cache writes and the attention stay
    outside, so the compiled graphs never mutate the caches (no copy of them can sneak in), and
    one graph per half serves every layer (`torch.compile` treats the weights as inputs) and
    every engine of a batch size. `DFLASH_COMPILE_DECODE=0` (or a non-CUDA device) runs them
    eagerly.
    """

    def __init__(self, device: torch.device, compiled: bool | None = None):
        self.projections = fused(step_projections, device, compiled)
        self.mlp = fused(step_mlp, device, compiled)


_COMPILED: dict = {}


def fused(fn, device: torch.device, compiled: bool | None = None):
    """`fn` compiled (by default on CUDA unless `DFLASH_COMPILE_DECODE=0`) or as it is. One
    compiled wrapper per function for the process, so every engine and session shares its
    graphs."""
    if compiled is None:
        compiled = device.type == "cuda" and os.environ.get("DFLASH_COMPILE_DECODE", "1") != "0"
    if not compiled:
        return fn
    if fn not in _COMPILED:
        # shapes left to automatic dynamism: the evaluation's steps come in a few query counts
        # (1 token, the block, the tree budget), each its own graph would hit the recompile limit
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]
