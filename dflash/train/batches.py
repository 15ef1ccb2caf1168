"""The tokenized rows and the epoch plans every rank derives identically, and the seeded generator
of each batch's anchors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import torch

from dflash.data.batching import bucket_batch_size, bucket_bounds, plan_epoch
from dflash.model.transfer import upload


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + index)


class Batches:
    """The tokenized rows and the epoch plans every rank derives identically.

    A compiled step is specialised to its shapes, so with `compile.enabled` a bucket's last,
    partial batch is padded with empty rows (no loss mask, hence no anchors and no loss) to the
    bucket's batch size: every batch then has one of the bucket shapes, which the warmup rule
    compiles from the config alone. The real rows' anchors are the same either way (a row's
    random keys do not depend on the rows after it).
    """

    def __init__(self, config: dict, data_path: Path):
        self.config, self.path = config, data_path
        self.rows = pl.read_parquet(data_path)
        # Every row's tokens in one flat array: a batch is a few slice copies instead of a
        # Python conversion per row (~25 ms for 16 rows of ~1,000 tokens, in the step's path).
        lengths = self.rows["length"].to_numpy()
        self.offsets = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
        self.flat_ids = torch.from_numpy(self.rows["input_ids"].explode().to_numpy().copy())
        self.flat_mask = torch.from_numpy(self.rows["loss_mask"].explode().to_numpy().copy())
        data = config["data"]
        self.bounds = bucket_bounds(data["buckets"], data["max_length"])
        self.pad = config["compile"]["enabled"]

    def shape(self, upper: int, rows: list[int]) -> tuple[int, int]:
        """(rows, width) of the batch `(upper, rows)` as it is fed to the step."""
        if not self.pad:
            return len(rows), upper
        data = self.config["data"]
        return bucket_batch_size(upper, data["token_budget"], data["max_batch_size"]), upper

    def shapes(self) -> list[tuple[int, int]]:
        """Every batch shape of an epoch, by length (the warmup's order: the same graphs in the
        sequence it filled the compile cache)."""
        return sorted({self.shape(u, rows) for u, rows in self.plan(0)}, key=lambda s: s[::-1])

    def plan(self, epoch: int) -> list[tuple[int, list[int]]]:
        data = self.config["data"]
        return plan_epoch(
            self.rows["length"].to_list(),
            self.bounds,
            data["token_budget"],
            data["max_batch_size"],
            self.config["seed"],
            epoch,
        )

    def tokens(self, rows: list[int]) -> int:
        """The real tokens of a batch (no device tensor read, so no host sync)."""
        return sum(self.offsets[row + 1] - self.offsets[row] for row in rows)

    def tensors(self, rows: list[int], width: int, device: torch.device):
        """Right-padded (input_ids, loss_mask, attention_mask) of a batch, `shape()` rows."""
        ids = torch.zeros(self.shape(width, rows), dtype=torch.long)
        mask = torch.zeros_like(ids)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            start, end = self.offsets[row], self.offsets[row + 1]
            ids[i, : end - start] = self.flat_ids[start:end]
            mask[i, : end - start] = self.flat_mask[start:end]
            attention[i, : end - start] = 1
        return upload(ids, device), upload(mask, device), upload(attention, device)
