"""The optimizer's step alone at a drafter's shapes (issue 57: what Muon costs beside AdamW):
training's own `dflash.train.optim.build` over a drafter held as training holds it (fp32
parameters on the device), random gradients, the median seconds of `--steps` steps after two
warm ones, each optimizer in a fresh drafter.

    python bench/optimizer_step.py [--shape 8b|recipe] [--optimizers adamw,muon,muon,adamw]
    python bench/optimizer_step.py --shape recipe --optimizers muon-torch,muon,muon,muon-torch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from drafter_step import SHAPES

from dflash.config import load_config
from dflash.model.drafter import Drafter
from dflash.train import optim

ROOT = Path(__file__).resolve().parents[1]


def time_optimizer(shape: str, name: str, steps: int, device: torch.device) -> dict:
    """`name`: adamw, muon (training's: GroupedMuon) or muon-torch (torch's Muon, a matrix at a
    time, as training stepped before GroupedMuon)."""
    config = load_config(ROOT / "config" / "config.yaml")  # train.* as a run reads them
    config["train"]["optimizer"] = name.removesuffix("-torch")
    torch.manual_seed(0)
    with device:
        drafter = Drafter(SHAPES[shape]())
        for p in drafter.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    with (
        mock.patch.object(optim, "_muon_class", lambda: torch.optim.Muon)
        if name == "muon-torch"
        else nullcontext()
    ):
        optimizer, _ = optim.build(drafter, config, total_steps=100, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 2):
        sync()
        t0 = time.perf_counter()
        optimizer.step()
        sync()
        if i >= 2:  # the first creates the state
            times.append(time.perf_counter() - t0)
    matrices, rest = optim.split_for_muon(drafter)
    record = {
        "optimizer": name,
        "shape": shape,
        "step_s": round(statistics.median(times), 5),
        "min_s": round(min(times), 5),
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "matrix_parameters": sum(p.numel() for _, p in matrices),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    del optimizer, drafter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--optimizers", default="adamw,muon,muon,adamw")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="optimizer_step.json")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for name in args.optimizers.split(","):
        records.append(time_optimizer(args.shape, name, args.steps, device))
        print(json.dumps(records[-1]), flush=True)
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
