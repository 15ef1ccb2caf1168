"""The drafter's optimiser and learning-rate schedule.

- `train.optimizer: adamw` (the recipe): AdamW over every trained parameter, betas 0.9/0.95,
  fused on GPU, a cosine schedule with `train.warmup_ratio` of warmup.
- `train.optimizer: muon`: torch's Muon (torch >= 2.9) for the drafter's weight matrices (every
  projection of its layers and `fc`), AdamW at `train.lr` for what is not a matrix (the RMSNorm
  weights); Muon's peak lr is `train.muon.lr_scale` x the AdamW one. The drafter holds no
  embedding or LM head (they are the target's, frozen), so no matrix is left to AdamW. Both
  follow the same schedule, are clipped together (`train.grad_clip`, before either steps) and
  checkpoint as one state: {"adamw": ..., "muon": ...}.
- A fine-tune (`drafter.init` not random) takes `train.finetune`: its own peak lr, warmup in
  steps, and the first `freeze_layers` drafter layers frozen (no gradient, not in the optimiser).

Either way the weights stay fp32 (master weights); under DDP every drafter rank steps the same
all-reduced gradients, so Muon's orthogonalised update is the same on every rank.
"""

from __future__ import annotations

import logging
import math

import torch

from dflash.config import ConfigError, finetune_set
from dflash.model.precision import native_bf16

log = logging.getLogger(__name__)


def cosine_with_warmup(total_steps: int, warmup_ratio: float, warmup_steps: int | None = None):
    """lr factor per step: linear warmup over `warmup_steps` (else `warmup_ratio` of the run),
    then cosine to 0 at `total_steps`."""
    steps = round(total_steps * warmup_ratio) if warmup_steps is None else warmup_steps
    warmup = max(1, steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def finetuning(config: dict) -> bool:
    """The drafter starts from trained weights (`drafter.init` other than random)."""
    return config["drafter"]["init"] != "random"


def schedule(config: dict) -> tuple[float, float, int | None]:
    """(peak lr, warmup ratio, warmup steps or None) the run trains with: `train.finetune`'s where
    it sets them on a fine-tune, else `train.lr` and `train.warmup_ratio`."""
    t = config["train"]
    tune = t["finetune"] if finetuning(config) else {}
    lr = tune.get("lr") or t["lr"]
    return lr, t["warmup_ratio"], tune.get("warmup_steps")


def freeze_layers(drafter, config: dict) -> list[str]:
    """Freeze the first `train.finetune.freeze_layers` layers of a fine-tune (requires_grad off,
    before DDP sees the module); returns the frozen parameters' names."""
    n = config["train"]["finetune"]["freeze_layers"] if finetuning(config) else 0
    frozen = []
    for i in range(n):
        for name, p in drafter.layers[i].named_parameters():
            p.requires_grad_(False)
            frozen.append(f"layers.{i}.{name}")
    return frozen


def split_for_muon(drafter) -> tuple[list, list]:
    """([(name, matrix)] for Muon, [(name, parameter)] for AdamW) of the trained parameters."""
    matrices, rest = [], []
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            (matrices if p.ndim == 2 and min(p.shape) > 1 else rest).append((name, p))
    return matrices, rest


def _muon_class():
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ConfigError(
            f"train.optimizer: muon needs torch.optim.Muon (torch 2.9 or later); this environment "
            f"has torch {torch.__version__}: install a newer torch or set train.optimizer: adamw"
        )
    from dflash.train.muon import GroupedMuon  # subclasses torch.optim.Muon: only where it is

    return GroupedMuon


class Optimizers:
    """Several optimisers stepped, zeroed and checkpointed as one, by name."""

    def __init__(self, **named: torch.optim.Optimizer):
        self.named = named

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.named.values() for g in o.param_groups]

    def step(self) -> None:
        for o in self.named.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.named.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, o in self.named.items():
            o.load_state_dict(state[k])


class Schedules:
    """One LambdaLR per optimiser of an `Optimizers`, with the same factor; `get_last_lr()`
    lists AdamW's first, so its [0] is the `train.lr` schedule, as with AdamW alone."""

    def __init__(self, optimizers: Optimizers, factor):
        self.named = {
            k: torch.optim.lr_scheduler.LambdaLR(o, factor) for k, o in optimizers.named.items()
        }

    def step(self) -> None:
        for s in self.named.values():
            s.step()

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.named.values() for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        return {k: s.state_dict() for k, s in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, s in self.named.items():
            s.load_state_dict(state[k])


def build(drafter, config: dict, total_steps: int, device: torch.device):
    """(optimizer, scheduler) for the drafter's trained parameters (freeze first)."""
    t = config["train"]
    lr, ratio, warmup_steps = schedule(config)
    factor = cosine_with_warmup(total_steps, ratio, warmup_steps)
    adamw = {"weight_decay": t["weight_decay"], "betas": (0.9, 0.95)}
    fused = device.type == "cuda"
    if t["optimizer"] == "adamw":
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, fused=fused, **adamw)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    muon = t["muon"]
    if not native_bf16(device):  # torch's Muon orthogonalises in bf16 whatever the device
        log.warning(
            "train.optimizer: muon on a %s without bf16 units: torch.optim.Muon runs its "
            "Newton-Schulz iterations in bf16, which this machine emulates (one 1536 x 576 matrix: "
            "4.7 s a step against AdamW's 7 ms on a 2-core AVX2 CPU); adamw is the choice here",
            device.type.upper(),
        )
    matrices, rest = split_for_muon(drafter)
    named = {}
    if rest:
        named["adamw"] = torch.optim.AdamW([p for _, p in rest], lr=lr, fused=fused, **adamw)
    named["muon"] = _muon_class()(
        [p for _, p in matrices],
        lr=lr * muon["lr_scale"],
        weight_decay=muon["weight_decay"],
        momentum=muon["momentum"],
        adjust_lr_fn=muon["adjust_lr"],
    )
    optimizers = Optimizers(**named)
    return optimizers, Schedules(optimizers, factor)


def contract(config: dict) -> dict:
    """The resume contract's entries for these settings, only where they differ from the
    recipe's, so that runs from before them keep their contract (and their run folder)."""
    t, out = config["train"], {}
    if t["optimizer"] != "adamw":
        out["optimizer"] = {"name": t["optimizer"], **t["muon"]}
    if finetuning(config) and finetune_set(t["finetune"]):
        out["finetune"] = t["finetune"]
    return out
