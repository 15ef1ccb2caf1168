"""length_stats: how long the training rows are, how they batch, and how that drifted.

The bucket table is the one batching uses: a row goes to the first bucket whose upper bound holds
it, a bucket's batch size is `min(max_batch_size, token_budget // upper)`, so the number of batches
per epoch and the share of batches in the longest bucket follow directly (long buckets cost the
most per token; a dataset whose longest-bucket share grows gets slower per token). With the
expanded rows beside them, the same summaries are given per domain (code, math, chat, ...).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import polars as pl

from dflash.data.batching import bucket_batch_size, bucket_bounds
from dflash.io import atomic_path, read_json, write_json

log = logging.getLogger(__name__)
QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAM_BINS = 32


def _summary(col: pl.Series) -> dict:
    out = {"mean": round(float(col.mean()), 3), "max": int(col.max()), "min": int(col.min())}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = round(float(col.quantile(q, interpolation="linear")), 3)
    return out


def bucket_table(lengths: pl.Series, bounds: list[int], token_budget: int, max_batch_size: int):
    rows, lower = [], 0
    for upper in bounds:
        in_bucket = lengths.filter((lengths > lower) & (lengths <= upper))
        batch_size = bucket_batch_size(upper, token_budget, max_batch_size)
        n = in_bucket.len()
        rows.append(
            {
                "lower": lower,
                "upper": upper,
                "rows": n,
                "batch_size": batch_size,
                "batches": math.ceil(n / batch_size),
                "tokens": int(in_bucket.sum()),
                # real tokens / padded tokens if every row is padded to the bucket bound
                "fill": round(int(in_bucket.sum()) / (n * upper), 4) if n else None,
            }
        )
        lower = upper
    return rows


def length_stats(frame: pl.DataFrame, buckets, max_length, token_budget, max_batch_size) -> dict:
    lengths, trainable = frame["length"], frame["trainable"]
    bounds = bucket_bounds(buckets, max_length)
    table = bucket_table(lengths, bounds, token_budget, max_batch_size)
    batches = sum(b["batches"] for b in table)
    width = max(1, math.ceil(max_length / HISTOGRAM_BINS))
    histogram = ((lengths - 1) // width).value_counts().sort(lengths.name)
    return {
        "rows": frame.height,
        "tokens": int(lengths.sum()),
        "trainable_tokens": int(trainable.sum()),
        "length": _summary(lengths),
        "trainable": _summary(trainable),
        "histogram": {
            "bin_width": width,
            "counts": {str(int(b) * width + 1): int(c) for b, c in histogram.iter_rows()},
        },
        "buckets": table,
        "batches_per_epoch": batches,
        "longest_bucket_share": round(table[-1]["batches"] / batches, 4) if batches else 0.0,
        "token_budget": token_budget,
        "max_batch_size": max_batch_size,
        "max_length": max_length,
    }


def domain_stats(frame: pl.DataFrame) -> dict:
    """Rows, tokens and length summaries of each domain (the `domain` column), and each domain's
    share of the trainable tokens: what the mixture is once tokenized, not only in rows."""
    total = max(1, int(frame["trainable"].sum()))
    out = {}
    for (domain,), part in sorted(frame.group_by("domain"), key=lambda g: str(g[0][0])):
        out[str(domain)] = {
            "rows": part.height,
            "tokens": int(part["length"].sum()),
            "trainable_tokens": int(part["trainable"].sum()),
            "trainable_share": round(int(part["trainable"].sum()) / total, 4),
            "length": _summary(part["length"]),
            "trainable": _summary(part["trainable"]),
        }
    return out


def with_domains(frame: pl.DataFrame, expanded: Path) -> pl.DataFrame:
    """The tokenized rows labelled with the expand stage's domain, joined by row id (a row
    expanded before domains existed, or without its id there, is `unknown`)."""
    labels = pl.read_parquet(expanded)
    if "domain" not in labels.columns:
        labels = labels.select("id").with_columns(pl.lit("unknown").alias("domain"))
    joined = frame.join(labels.select("id", "domain"), on="id", how="left")
    return joined.with_columns(pl.col("domain").fill_null("unknown"))


DRIFT_KEYS = {
    "rows": ("rows",),
    "mean length": ("length", "mean"),
    "p90 length": ("length", "p90"),
    "mean trainable": ("trainable", "mean"),
    "batches per epoch": ("batches_per_epoch",),
    "longest-bucket share": ("longest_bucket_share",),
}


def drift(old: dict, new: dict) -> dict:
    """Change of the headline numbers against an earlier stats file, with readable lines."""
    out = {}
    for name, path in DRIFT_KEYS.items():
        a, b = old, new
        for key in path:
            a, b = a[key], b[key]
        pct = round(100 * (b - a) / a, 1) if a else None
        if name == "longest-bucket share":
            line = f"{name} {a * 100:.0f} % -> {b * 100:.0f} %"
        else:
            line = f"{name} {a:g} -> {b:g}" + (f", {pct:+.1f} %" if pct is not None else "")
        out[name] = {"old": a, "new": b, "change_pct": pct, "line": line}
    return out


def plot(stats: dict, lengths: pl.Series, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    ax.hist(
        lengths.to_numpy(), bins=HISTOGRAM_BINS, range=(0, stats["max_length"]), color="#4477aa"
    )
    for bucket in stats["buckets"]:
        ax.axvline(bucket["upper"], color="#cc6677", linestyle="--", linewidth=1)
    ax.set_xlabel("tokens per row (dashed: bucket bounds)")
    ax.set_ylabel("rows")
    ax.set_title(
        f"{stats['rows']} rows, mean {stats['length']['mean']:.0f} tokens, "
        f"{stats['batches_per_epoch']} batches/epoch"
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)


def run(args) -> dict | None:
    data_cfg = args.config["data"]
    frame = pl.read_parquet(args.input, columns=["id", "length", "trainable"])
    stats = length_stats(
        frame,
        data_cfg["buckets"],
        data_cfg["max_length"],
        data_cfg["token_budget"],
        data_cfg["max_batch_size"],
    )
    if args.domains:
        stats["domains"] = domain_stats(with_domains(frame, args.domains))
        for name, d in stats["domains"].items():
            log.info(
                "stats: %s %d rows, mean length %.1f, %.1f %% of trainable tokens",
                name,
                d["rows"],
                d["length"]["mean"],
                100 * d["trainable_share"],
            )
    previous = args.previous or data_cfg["previous_stats"]
    if previous:
        stats["drift"] = drift(read_json(previous), stats)
        for item in stats["drift"].values():
            log.info("drift: %s", item["line"])
    write_json(args.json, stats)
    plot(stats, frame["length"], args.plot)
    log.info(
        "stats: %d rows, mean length %.1f, %d batches/epoch, longest-bucket share %.1f %%",
        stats["rows"],
        stats["length"]["mean"],
        stats["batches_per_epoch"],
        100 * stats["longest_bucket_share"],
    )
    return {"inputs": {"previous": previous}} if previous else None
