"""Length-bucketed batches under a token budget, in a seeded order.

A row goes to the first bucket whose upper bound holds it; a bucket's batch size is
`min(max_batch_size, token_budget // upper)` (at least 1), so every batch pads to one of a few
fixed shapes, the shapes the compile warmup prepares. Rows are shuffled within buckets and the
batches are shuffled across buckets, both from `(seed, epoch)`: the same config gives the same
batches in the same order on every rerun. `length_stats` reports the same table.
"""

from __future__ import annotations

import bisect
import random


def bucket_bounds(buckets: list[int], max_length: int) -> list[int]:
    return sorted({b for b in buckets if b < max_length} | {max_length})


def bucket_batch_size(upper: int, token_budget: int, max_batch_size: int) -> int:
    return max(1, min(max_batch_size, token_budget // upper))


def plan_epoch(
    lengths: list[int],
    bounds: list[int],
    token_budget: int,
    max_batch_size: int,
    seed: int,
    epoch: int,
) -> list[tuple[int, list[int]]]:
    """[(bucket upper bound, row indices)] for one epoch."""
    rng = random.Random(f"{seed}/{epoch}")
    members: dict[int, list[int]] = {upper: [] for upper in bounds}
    for row, length in enumerate(lengths):
        i = bisect.bisect_left(bounds, length)
        if i == len(bounds):
            raise ValueError(
                f"row {row} has {length} tokens, more than the last bucket {bounds[-1]}"
            )
        members[bounds[i]].append(row)
    batches = []
    for upper, rows in members.items():
        rng.shuffle(rows)
        size = bucket_batch_size(upper, token_budget, max_batch_size)
        batches += [(upper, rows[i : i + size]) for i in range(0, len(rows), size)]
    rng.shuffle(batches)
    return batches


def route(batch_index: int, targets: int, drafters: int) -> tuple[int, int]:
    """Global batch i is computed by target `i % T` and trained on by drafter `i % D`."""
    return batch_index % max(targets, 1), batch_index % drafters
