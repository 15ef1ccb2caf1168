"""The `merge-shards` stage: regeneration's shards (`data.regenerate.shards`, one job each)
back into one split in the input's row order. Its own module, without torch: a stage that only
concatenates tables should not pay torch's import (2 s a process on a 2-core CPU)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from dflash.data.expand import read_rows
from dflash.data.sources import DataError
from dflash.io import atomic_path


def merge_shards(input_path: Path, shard_files: list[Path], output: Path) -> None:
    """Concatenate shards back into the input's row order, checking nothing is lost or doubled."""
    expected = [r["id"] for r in read_rows(input_path)]
    frame = pl.concat([pl.read_parquet(f) for f in shard_files])
    got = frame["id"].to_list()
    if sorted(got) != sorted(expected):
        missing = len(set(expected) - set(got))
        doubled = len(got) - len(set(got))
        raise DataError(
            f"regenerated shards {shard_files} do not match {input_path}: "
            f"{missing} rows missing, {doubled} duplicated"
        )
    position = {row_id: i for i, row_id in enumerate(expected)}
    frame = frame.with_columns(pl.col("id").replace_strict(position).alias("_pos"))
    with atomic_path(output) as tmp:
        frame.sort("_pos").drop("_pos").write_parquet(tmp, statistics=False)


def run(args) -> None:
    merge_shards(args.input, args.shard_files, args.output)
