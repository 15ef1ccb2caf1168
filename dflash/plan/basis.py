"""What every stage's figure is built from: the plan, a figure, and the choice of the measurement
a stage starts from (`pick`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.errors import UserError
from dflash.plan.rates import GPUS, PRESETS, RATES
from dflash.plan.shapes import Data, Drafter, Shape

MEMORY_USE = 0.9  # the share of a GPU's memory regeneration may fill with weights and KV cache
CLOSE = 0.05  # a workload figure within 5 % of the measurement's counts as the same
# the most of a GPU a target's weights may take beside a training drafter: at 8B shapes the
# colocated 0 + 1 peaked at 42.5 GB, 16.4 of them the target's (BENCHMARKS.md 2026-12-02 evening)
TRAIN_TARGET_SHARE = 0.6


@dataclass
class Plan:
    name: str
    shape: Shape
    target_source: str
    data: Data
    epochs: int = 1
    gpus: int = 1
    gpu: str = "h200"
    targets: int = 0  # 0: colocated, every GPU a drafter that runs its own target
    drafter: Drafter = Drafter()
    max_length: int = 2048
    buckets: int = 3
    regen_batch: int = 1024
    max_new_tokens: int = 2048
    eval_prompts: int = 104
    eval_new_tokens: int = 256
    checkpoints: int | None = None  # None: one at each epoch's end
    rates: list = field(default_factory=lambda: list(RATES))

    @property
    def drafters(self) -> int:
        return self.gpus - self.targets


@dataclass
class Figure:
    stage: str
    seconds: float
    rate: str
    basis: str  # "measured" or "projected"
    how: str
    source: str


def rate_shape(rate: dict) -> Shape:
    t = rate["target"]
    return Shape.from_config(PRESETS[t] if isinstance(t, str) else t, rate["source"])


def pick(p: Plan, stage: str, near=None) -> dict:
    """The measurement a stage starts from: the plan's own (shape, GPU kind) first, then its GPU
    kind, then its shape; then the nearest in parameters; then, where `near` (an entry's
    distance from the plan's workload) is given, the nearest workload; earlier entries win ties."""
    usable = [r for r in p.rates if r["stage"] == stage and r["gpu"] in GPUS]
    if not usable:
        raise UserError(f"no measured {stage} rate to plan from")

    def rank(r):
        other = rate_shape(r)
        params = abs(math.log(other.params / p.shape.params))
        return (other != p.shape, r["gpu"] != p.gpu, params, near(r) if near else 0)

    return min(usable, key=rank)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= CLOSE * abs(b)


def same_setting(rate: dict, p: Plan) -> bool:
    return rate_shape(rate) == p.shape and rate["gpu"] == p.gpu


def basis(measured: bool) -> str:
    return "measured" if measured else "projected"


def kilo(x: float) -> str:
    return f"{x / 1e3:,.1f}K" if x >= 1e3 else f"{x:,.1f}"
