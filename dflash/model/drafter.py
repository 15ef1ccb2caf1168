"""The DFlash drafter: Qwen3-style layers whose keys/values also cover the target's context.

Per layer, queries come only from the block tokens; keys and values are the same projections
applied to `[context; block]`, with q/k RMSNorm and RoPE on the true positions. The context is
`hidden_norm(fc(concat of target layer features))`. The embedding and LM head are the target's
(frozen, not saved). Saved as an HF directory whose keys and config fields are the ones the public
DFlash loader reads.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.io import atomic_path, write_json
from dflash.model import modeling_dflash
from dflash.model.layer_ids import check_layer_ids, default_layer_ids
from dflash.model.rope import apply_rope


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    rope_scaling: dict | None = field(default=None)

    @classmethod
    def for_target(
        cls,
        target_config,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
    ) -> DrafterConfig:
        """Width, heads and RoPE from the target; depth, block size and mask token from us."""
        t = getattr(target_config, "get_text_config", lambda: target_config)()
        rope = getattr(t, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", "default") == "default":
            scaling = None
        check_layer_ids(target_layer_ids, t.num_hidden_layers, num_layers, t.model_type)
        return cls(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            vocab_size=t.vocab_size,
            block_size=block_size,
            num_target_layers=t.num_hidden_layers,
            target_layer_ids=target_layer_ids or default_layer_ids(t.num_hidden_layers, num_layers),
            mask_token_id=mask_token_id,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=theta,
            max_position_embeddings=t.max_position_embeddings,
            rope_scaling=scaling,
        )

    def to_hf(self) -> dict:
        """config.json as the public DFlash loader reads it (Qwen3 fields + DFlash fields)."""
        d = asdict(self)
        dflash = {
            "mask_token_id": d.pop("mask_token_id"),
            "target_layer_ids": d.pop("target_layer_ids"),
        }
        rope_parameters = {
            "rope_theta": self.rope_theta,
            "rope_type": "default",
            **(self.rope_scaling or {}),
        }
        d.pop("rope_scaling")
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **d,
            "rope_parameters": rope_parameters,
            "rope_scaling": self.rope_scaling,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dflash_config": dflash,
        }

    @classmethod
    def from_hf(cls, d: dict) -> DrafterConfig:
        names = cls.__dataclass_fields__
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.update(d["dflash_config"])
        if "rope_theta" not in kwargs and "rope_parameters" in d:
            kwargs["rope_theta"] = d["rope_parameters"]["rope_theta"]
        return cls(**kwargs)

    def qwen3(self):
        from transformers import Qwen3Config

        return Qwen3Config(
            **{
                k: v
                for k, v in self.to_hf().items()
                if k not in ("architectures", "dflash_config", "model_type")
            }
        )


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attend, cache=None, layer: int = 0):
        """Attention of the block queries over `[context; block]`. With a `cache`, the new
        context rows' keys/values are stored and the block attends over everything cached."""
        q, k, v = self.project(x, ctx, rope_q, rope_kv)
        if cache is not None:
            k, v = cached(cache, layer, k, v, ctx.shape[1])
        return self.output(attend(q, k, v))

    def project(self, x, ctx, rope_q, rope_kv):
        """Queries of the block x; keys and values of `[ctx; x]`; normed and rotated."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, *rope_q), apply_rope(k, *rope_kv), v

    def output(self, attended):
        b, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


def cached(cache, layer: int, k, v, s: int):
    """Store the new context rows (the first s) of k, v in the cache; return every cached row's
    keys and values followed by the block's."""
    k_ctx, v_ctx = cache.update(layer, k[:, :, :s], v[:, :, :s])
    return torch.cat([k_ctx, k[:, :, s:]], dim=2), torch.cat([v_ctx, v[:, :, s:]], dim=2)


def layer_projections(layer, x, ctx, rope_q, rope_kv):
    """A layer up to its attention: what decoding fuses before the cache and the attention."""
    return layer.self_attn.project(layer.input_layernorm(x), ctx, rope_q, rope_kv)


def layer_rest(layer, x, attended):
    """A layer after its attention: the output projection, the residuals, the MLP."""
    x = x + layer.self_attn.output(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attend, cache=None, layer: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attend, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DrafterCache:
    """Per-layer K/V of the committed context (block rows are never cached), grown by
    concatenation. `dflash.model.engine.StaticDrafterCache` is the preallocated twin."""

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self):
        return 0 if not self.kv else self.kv[0][0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the new context rows of `layer`; return all its cached keys and values."""
        if layer == len(self.kv):
            self.kv.append((k, v))
        else:
            k0, v0 = self.kv[layer]
            self.kv[layer] = (torch.cat([k0, k], 2), torch.cat([v0, v], 2))
        return self.kv[layer]


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        self.config = config
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(
            len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config.qwen3())
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, output_norm: float = 0.1):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        # The shared LM head's rows are large: a unit-RMS random hidden state gives logits so
        # spread that the first loss is ~53 instead of ~ln(vocab). Starting the final norm small
        # starts near uniform (first loss 13): on the CPU default one epoch ends at loss 7.4
        # instead of 8.5.
        nn.init.constant_(self.norm.weight, output_norm)

    def rope(self, x, positions):
        cos, sin = self.rotary(x, positions)
        return cos.to(x.dtype), sin.to(x.dtype)

    def forward(
        self,
        block_embeds,
        ctx_features,
        block_positions,
        ctx_positions,
        attend,
        cache=None,
        layer_fn=None,
        pieces=None,
    ):
        """Final hidden states (after `norm`) of the block tokens.

        block_embeds: (b, q, H) target embeddings of the block tokens; ctx_features: (b, s, n*H)
        new context features (all of them in training; only not-yet-cached ones with a cache);
        attend(q, k, v) realises the attention mask; `cache` (a DrafterCache or a static twin)
        keeps the context keys/values between calls. `layer_fn(layer, x, ctx, rope_q, rope_kv,
        attend)` runs each layer instead of calling it (training's compiled layer, `run_layer`);
        `pieces` (`layer_projections`, `layer_rest`; fused in decoding) run it around the cache.
        """
        ctx = self.hidden_norm(self.fc(ctx_features))
        x = block_embeds
        rope_q = self.rope(x, block_positions)
        rope_kv = self.rope(x, torch.cat([ctx_positions, block_positions], dim=1))
        for i, layer in enumerate(self.layers):
            if pieces is not None:
                projections, rest = pieces
                q, k, v = projections(layer, x, ctx, rope_q, rope_kv)
                k, v = cached(cache, i, k, v, ctx.shape[1])
                x = rest(layer, x, attend(q, k, v))
            elif layer_fn is None:
                x = layer(x, ctx, rope_q, rope_kv, attend, cache, i)
            else:
                x = layer_fn(layer, x, ctx, rope_q, rope_kv, attend)
        return self.norm(x)


def run_layer(layer, x, ctx, rope_q, rope_kv, attend):
    """One drafter layer, as a function of the layer: compiled, its graph serves every layer
    (`torch.compile` treats the weights as inputs)."""
    return layer(x, ctx, rope_q, rope_kv, attend)


class LayerCompiled(nn.Module):
    """The drafter with its layers compiled one at a time (regional compilation); the rest (fc,
    norms, RoPE tables) runs eagerly. Dynamo traces two layers per batch shape however deep the
    drafter: the first (its input needs no gradient) and one graph every later layer shares. So
    a warm start loads far less than the whole drafter's graph and a cold start compiles less
    (bench/gpu.py: 7.0 s against 10.1 s warm, 205 s against 271 s cold, on an 8B target's
    5-layer drafter), at the same step time."""

    def __init__(self, drafter: Drafter, mode: str = "default"):
        super().__init__()
        self.drafter = drafter
        self.config = drafter.config
        self.layer_fn = torch.compile(run_layer, dynamic=False, mode=mode)

    def forward(self, block_embeds, ctx_features, block_positions, ctx_positions, attend):
        return self.drafter(
            block_embeds, ctx_features, block_positions, ctx_positions, attend,
            layer_fn=self.layer_fn,
        )  # fmt: skip


WEIGHTS = "model.safetensors"
# The modeling file every exported directory ships, and the class config.json's auto_map names:
# `AutoModel.from_pretrained(dir, trust_remote_code=True)` then builds the drafter itself.
# Imported (not only read) so that it is part of the training code's hash: a change to it
# reruns the export.
MODELING = Path(modeling_dflash.__file__)
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}


def save_drafter(model: Drafter, directory, dtype=torch.bfloat16, trained_on=None) -> None:
    """Write config.json + model.safetensors + the modeling file atomically (a whole directory);
    `trained_on`: how its training answers were made (`sampling.serving_mode`), as config.json's
    `dflash_training_answers` (loaders ignore keys they do not know)."""
    with atomic_path(directory, is_dir=True) as tmp:
        state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        config = model.config.to_hf()
        if trained_on is not None:
            config["dflash_training_answers"] = trained_on
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        config["auto_map"] = AUTO_MAP
        write_json(tmp / "config.json", config)
        shutil.copyfile(MODELING, tmp / "dflash.py")


def load_drafter(directory: str | Path, dtype=torch.float32, device="cpu") -> Drafter:
    directory = Path(directory)
    config = DrafterConfig.from_hf(json.loads((directory / "config.json").read_text()))
    with torch.device(device):
        model = Drafter(config)
    state = load_file(directory / WEIGHTS, device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: missing keys {missing}, unexpected keys {unexpected}")
    return model.to(dtype)
