import random

import polars as pl

from dflash.data.batching import bucket_bounds, plan_epoch, route
from dflash.data.stats import length_stats


def make_lengths(n=500, seed=0):
    rng = random.Random(seed)
    return [rng.randint(1, 512) for _ in range(n)]


def test_every_row_once_in_budgeted_same_bucket_batches():
    lengths = make_lengths()
    bounds = bucket_bounds([128, 256, 384], 512)
    batches = plan_epoch(lengths, bounds, token_budget=2048, max_batch_size=12, seed=1, epoch=0)
    rows = [r for _, batch in batches for r in batch]
    assert sorted(rows) == list(range(len(lengths)))
    for upper, batch in batches:
        lower = bounds[bounds.index(upper) - 1] if upper != bounds[0] else 0
        assert all(lower < lengths[r] <= upper for r in batch)
        assert len(batch) <= max(1, min(12, 2048 // upper))


def test_order_is_seeded_per_epoch():
    lengths = make_lengths()
    bounds = bucket_bounds([128, 256], 512)
    a = plan_epoch(lengths, bounds, 2048, 12, seed=1, epoch=0)
    assert a == plan_epoch(lengths, bounds, 2048, 12, seed=1, epoch=0)
    assert a != plan_epoch(lengths, bounds, 2048, 12, seed=1, epoch=1)
    assert a != plan_epoch(lengths, bounds, 2048, 12, seed=2, epoch=0)


def test_batch_count_agrees_with_length_stats():
    lengths = make_lengths()
    frame = pl.DataFrame({"length": lengths, "trainable": lengths})
    stats = length_stats(frame, [128, 256, 384], 512, token_budget=2048, max_batch_size=12)
    batches = plan_epoch(lengths, bucket_bounds([128, 256, 384], 512), 2048, 12, seed=0, epoch=0)
    assert len(batches) == stats["batches_per_epoch"]


def test_routing_is_round_robin():
    assert [route(i, 2, 3) for i in range(6)] == [(0, 0), (1, 1), (0, 2), (1, 0), (0, 1), (1, 2)]
    assert route(5, 0, 2) == (0, 1)  # colocated: no target ranks
