import random

import polars as pl
import torch

from dflash.data.batching import bucket_bounds, plan_epoch, route
from dflash.data.stats import length_stats
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.objective import dflash_loss
from dflash.train.batches import Batches
from dflash.train.warmup import bucket_shapes


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


def batches(tmp_path, compiled: bool) -> Batches:
    """Five rows of 3 to 7 tokens (two buckets of batch size 2: the last batch of each is partial)."""
    rng = random.Random(0)
    ids = [[rng.randrange(10, 50) for _ in range(n)] for n in (3, 5, 7, 6, 4)]
    masks = [[0] + [1] * (len(row) - 1) for row in ids]
    path = tmp_path / "rows.parquet"
    frame = {"input_ids": ids, "loss_mask": masks, "length": [len(r) for r in ids]}
    pl.DataFrame(frame).write_parquet(path)
    data = {"buckets": [4], "max_length": 8, "token_budget": 16, "max_batch_size": 2}
    return Batches({"data": data, "seed": 0, "compile": {"enabled": compiled}}, path)


def test_compiled_batches_have_the_warmup_shapes_and_padding_changes_no_loss(tmp_path):
    eager, compiled = batches(tmp_path, False), batches(tmp_path, True)
    assert sorted({compiled.shape(u, r) for u, r in compiled.plan(0)}) == bucket_shapes(
        compiled.config["data"]
    )
    config = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, num_target_layers=4,
        target_layer_ids=[1], mask_token_id=3, rope_theta=10000.0, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter, embed = Drafter(config), torch.nn.Embedding(50, 32)
    partial = [(u, r) for u, r in compiled.plan(0) if len(r) == 1]
    assert partial, "the plan has a partial batch to pad"
    for upper, rows in partial:
        ids, mask, attention = compiled.tensors(rows, upper, "cpu")
        assert ids.shape == (2, upper) and not attention[1:].any() and not mask[1:].any()
        assert [t.tolist() for t in eager.tensors(rows, upper, "cpu")] == [
            t[:1].tolist() for t in (ids, mask, attention)
        ]
        losses, real = [], torch.randn(1, upper, 32)
        for i, m in ((ids, mask), (ids[:1], mask[:1])):
            features = real.expand(i.shape[0], -1, -1)
            loss, _ = dflash_loss(
                drafter, embed, embed.weight, features, i, m, torch.Generator().manual_seed(1), 8
            )
            losses.append(loss.item())
        assert losses[0] == losses[1]
