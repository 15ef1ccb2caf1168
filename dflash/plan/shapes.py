"""What a plan is about: the target's shape, the drafter, the data, and the FLOPs they cost."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import UserError
from dflash.plan.rates import PRESETS

BF16 = 2  # bytes per weight and per cached value


@dataclass(frozen=True)
class Shape:
    """The fields of a target's HF config.json that its cost depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict, where: str) -> Shape:
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        try:
            heads = cfg["num_attention_heads"]
            return cls(
                hidden=cfg["hidden_size"],
                layers=cfg["num_hidden_layers"],
                heads=heads,
                kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate=cfg["intermediate_size"],
                vocab=cfg["vocab_size"],
                tied=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise UserError(f"{where}: the model config has no {e.args[0]}") from None

    def config(self) -> dict:
        """The inverse of `from_config`."""
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
        }

    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate  # q, o; k, v; gate, up, down

    @property
    def params(self) -> int:
        """Parameters: layers (matmuls and two norms each), embedding, LM head unless tied, norm."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        per_layer = self.layer_matmul_params() + 2 * self.hidden
        return self.layers * per_layer + embeddings + self.hidden

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes per cached token (bf16)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16

    def forward_flops(self, n: float, layers: int | None = None, head: bool = True) -> float:
        """FLOPs of one causal forward over n tokens: matmuls, attention scores and values."""
        layers = self.layers if layers is None else layers
        attention = 4 * self.head_dim * self.heads * n * (n + 1) / 2
        logits = 2 * n * self.hidden * self.vocab if head else 0
        return layers * (2 * n * self.layer_matmul_params() + attention) + logits


def assumed_shape(params: float) -> Shape:
    """A Qwen3-like shape of about `params` parameters: head dim 128, 8 KV heads, an MLP 3x as
    wide, vocab 151,936, untied, width / depth about 100 (Qwen3-8B 114, Llama-3-70B 102)."""

    def shape(hidden: int, layers: int) -> Shape:
        return Shape(hidden, layers, hidden // 128, 8, 128, 3 * hidden, 151936, False)

    hidden = 1024
    while shape(hidden + 128, round((hidden + 128) / 100)).params <= params:
        hidden += 128
    bare = shape(hidden, 0).params
    per_layer = shape(hidden, 1).params - bare
    return shape(hidden, max(1, round((params - bare) / per_layer)))


# a checkpoint's bytes per trained parameter: fp32 weights and AdamW's two moments
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Drafter:
    layers: int = 5
    block_size: int = 16
    anchors: int = 512  # blocks per sample: dflash train always computes this many


def feature_flops(shape: Shape, n: float) -> float:
    """The target's forward in training: up to its deepest evenly spaced layer (L-3), no head."""
    return shape.forward_flops(n, layers=shape.layers - 2, head=False)


def drafter_flops(shape: Shape, drafter: Drafter, n: float, prompt: float) -> float:
    """Useful FLOPs of one sample's drafter step, as bench/drafter_step.py's `useful_flops` counts
    them: K/V and `fc` over the context, block tokens through every layer, attention over the
    keys a block sees (anchors sit mid-answer on average), the frozen LM head on block tokens;
    backward 2x the forward for trained parts, 1x for the head."""
    h, i, q = shape.hidden, shape.intermediate, shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    t = drafter.anchors * drafter.block_size
    anchor = (min(prompt, n) + n) / 2
    per_layer = (
        2 * t * h * q * 2  # q, o over block tokens
        + 2 * (n + t) * h * kv * 2  # k, v over context and block tokens
        + 2 * t * h * i * 3  # MLP
        + 4 * t * (anchor + drafter.block_size) * q  # attention
    )
    trained = drafter.layers * per_layer + 2 * n * drafter.layers * h * h  # fc: one layer each
    return 3 * trained + 2 * (2 * t * h * shape.vocab)


def drafter_params(shape: Shape, drafter: Drafter) -> int:
    """The drafter's trained parameters: its layers at the target's width, `fc` (one target
    layer's hidden state per drafter layer, as `drafter_flops` counts it) and its final norm."""
    h = shape.hidden
    return drafter.layers * (shape.layer_matmul_params() + 2 * h + h * h) + h


def sample_flops(shape: Shape, drafter: Drafter, n: float, prompt: float) -> float:
    return feature_flops(shape, n) + drafter_flops(shape, drafter, n, prompt)


@dataclass(frozen=True)
class Data:
    samples: int
    prompt_tokens: float  # means per sample
    new_tokens: float
    source: str

    def length(self, max_length: int) -> float:
        """Mean tokens a sample trains on."""
        return min(self.prompt_tokens + self.new_tokens, max_length)


def read_json(path: Path, where: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{where}: no such file: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: {path} is not JSON: {e}") from None


def data_from_stats(path: Path, where: str = "--stats") -> Data:
    """Rows and mean prompt / trainable tokens of a length_stats stats.json (per row: a
    conversation's earlier turns count as prompt)."""
    stats = read_json(path, where)
    try:
        rows, tokens, new = stats["rows"], stats["tokens"], stats["trainable_tokens"]
    except KeyError as e:
        raise UserError(f"{where}: {path} has no {e.args[0]} (not a stats.json?)") from None
    return Data(rows, (tokens - new) / rows, new / rows, f"{path}, means per row")


def resolve_target(value: str) -> tuple[str, Shape, str]:
    """(name, shape, source) of a preset name, a HF model folder or a config.json."""
    if value in PRESETS:
        return value, Shape.from_config(PRESETS[value], value), f"preset {value}"
    path = Path(value)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        known = ", ".join(sorted(PRESETS))
        raise UserError(f"--target: {value!r} is neither a preset ({known}) nor a config.json")
    shape = Shape.from_config(read_json(config, "--target"), f"--target {config}")
    return preset_name(shape) or config.resolve().parent.name, shape, str(config)


def preset_name(shape: Shape) -> str | None:
    """The preset of this very shape, if there is one."""
    return next((n for n, c in PRESETS.items() if Shape.from_config(c, n) == shape), None)
