"""Live training curves as TensorBoard event files, beside each run's checkpoints:

    tensorboard --logdir results/checkpoints

One folder per run (`run-<contract>/tensorboard`), so runs of other configs appear side by side.
A resumed run purges the events after the step it resumed from, as it does its live metrics.
metrics.jsonl stays the record; these files are only a view of it while the run goes on. Without
the `tensorboard` package (a lean GPU image), training says so once and carries on.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# metrics record key -> TensorBoard tag
SCALARS = {
    "loss": "train/loss",
    "tau": "train/tau_teacher_forced",
    "tau_sim": "train/tau_sim_held_out",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
}


class Board:
    def __init__(self, folder: Path, step: int, enabled: bool = True):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("train.tensorboard: the tensorboard package is not installed; no event files")
            return
        self.writer = SummaryWriter(str(folder), purge_step=step or None)

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key, tag in SCALARS.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], step)
        for k, acc in enumerate(record.get("acc", []), start=1):
            self.writer.add_scalar(f"acceptance_per_slot/{k:02d}", acc, step)
        self.writer.flush()  # live: a reader sees each step as it is logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
