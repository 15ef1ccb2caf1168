"""What a drafter rank reports of each optimizer step, apart from the step itself: the step as
queued (its metrics still device tensors, read once the next step is queued), the mean of its
micro-batches' metrics, and rank 0's progress: a tqdm bar on a terminal (step/total, with loss,
tau, tau_sim, lr, tokens/s and the feature queue's depth beside it), one log line per step
elsewhere (a log file, Snakemake's log)."""

from __future__ import annotations

import logging
import statistics
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dflash.model.objective import host_metrics
from dflash.train.telemetry import Window


@dataclass
class QueuedStep:
    """An optimizer step whose work is queued on the device; its line is written later."""

    step: int
    epoch: int
    batch: int
    lr: float
    grad_norm: torch.Tensor
    window: Window
    metrics: list[dict]  # each micro-batch's, device tensors
    tau_sim: dict  # tau_sim and tau_sim_first, when logged at this step

    def means(self) -> dict:
        """loss, tau and per-position acceptance over the step's micro-batches (waits for the
        device to finish the step)."""
        metrics = [host_metrics(m) for m in self.metrics]
        return {
            "loss": statistics.fmean(m["loss"] for m in metrics),
            "tau": statistics.fmean(m["tau"] for m in metrics),
            "acc": [statistics.fmean(a) for a in zip(*(m["acc"] for m in metrics), strict=True)],
        }


def describe(record: dict) -> str:
    """A step's record in a few words: loss, tau, tau_sim, lr, tokens/s (launch-bound when the
    GPU waited for the host's launches), queue depth."""
    queue = record.get("queue_depth")
    depth = f" queue {statistics.fmean(queue.values()):.1f}" if queue else ""
    sim = f" tau_sim {record['tau_sim']:.3f}" if "tau_sim" in record else ""
    if "tau_sim_first" in record:
        sim += f" (first answers {record['tau_sim_first']:.3f})"
    for key, value in record.items():  # at temperature: tau_sim_T=1 ...
        if key.startswith("tau_sim_T="):
            sim += f" {key.removeprefix('tau_sim_')} {value:.3f}"
    bound = " launch-bound" if record.get("launch_bound") else ""
    return (
        f"loss {record['loss']:.4f} tau {record['tau']:.3f}{sim} lr {record['lr']:.2e} "
        f"{record['tokens_per_s']:.0f} tok/s{bound}{depth}"
    )


class Progress:
    """Rank 0's progress through `total` optimizer steps, from `done` (a resumed run's step);
    without a terminal, each step is a line of `log` (the trainer's)."""

    def __init__(self, total: int, done: int, log: logging.Logger):
        self.total, self.log = total, log
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(
                total=total, initial=done, desc="train", unit="step", file=sys.stderr, leave=True
            )

    def update(self, record: dict) -> None:
        if self.bar is None:
            self.log.info("step %d/%d %s", record["step"], self.total, describe(record))
            return
        self.bar.set_postfix_str(describe(record), refresh=False)
        self.bar.update(record["step"] - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
