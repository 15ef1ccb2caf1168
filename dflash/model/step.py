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
        wrap=None,
    ):
        self.drafter = drafter
        self.model = torch.compile(drafter, dynamic=False) if compile else drafter
        if wrap is not None:  # e.g. DDP, around the compiled module the warmup prepared
            self.model = wrap(self.model)
            self.model.config = drafter.config
        self.embed_tokens, self.head_weight = embed_tokens, head_weight
        self.max_anchors, self.gamma, self.attention = max_anchors, gamma, attention
        self.compile = compile

    def __call__(self, features, input_ids, loss_mask, generator, loss_scale: float = 1.0):
        loss, metrics = self.loss(features, input_ids, loss_mask, generator)
        (loss * loss_scale).backward()
        return metrics

    def loss(self, features, input_ids, loss_mask, generator):
        # fp32 master weights; on GPU the step runs in bf16 autocast.
        device = input_ids.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            return dflash_loss(
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
                compiled_ce=self.compile and device == "cuda",
            )
