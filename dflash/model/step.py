"""The drafter training step as training runs it, so the warmup compiles exactly that code."""

from __future__ import annotations

import torch

from dflash.model.objective import dflash_loss


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_attention(name: str, device: torch.device) -> str:
    """flex_attention on GPU; on CPU torch's flex_attention has no backward, so SDPA."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("compile.attention=flex needs a GPU: flex_attention has no CPU backward")
    return name


class TrainStep:
    """Forward + backward of the DFlash loss for one batch; optionally compiled."""

    def __init__(
        self,
        drafter,
        embed_tokens,
        head_weight,
        *,
        max_anchors: int,
        gamma,
        attention,
        compile: bool,
    ):
        self.drafter = drafter
        self.model = torch.compile(drafter, dynamic=False) if compile else drafter
        self.embed_tokens, self.head_weight = embed_tokens, head_weight
        self.max_anchors, self.gamma, self.attention = max_anchors, gamma, attention
        self.compile = compile

    def __call__(self, features, input_ids, loss_mask, generator, loss_scale: float = 1.0):
        loss, metrics = dflash_loss(
            self.model,
            self.embed_tokens,
            self.head_weight,
            features,
            input_ids,
            loss_mask,
            generator,
            self.max_anchors,
            self.gamma,
            backend=self.attention,
            compiled_flex=self.compile and self.attention == "flex",
        )
        (loss * loss_scale).backward()
        return metrics
