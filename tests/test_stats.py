import polars as pl
import pytest

from dflash.data.stats import drift, length_stats


def stats_for(lengths, trainable):
    frame = pl.DataFrame({"length": lengths, "trainable": trainable})
    return length_stats(frame, buckets=[16, 64], max_length=128, token_budget=128, max_batch_size=4)


def test_hand_computed_case():
    s = stats_for([10, 20, 30, 100], [5, 10, 15, 50])
    assert s["rows"] == 4 and s["tokens"] == 160 and s["trainable_tokens"] == 80
    # linear interpolation over the sorted lengths [10, 20, 30, 100]
    assert s["length"] == {
        "mean": 40.0,
        "min": 10,
        "max": 100,
        "p50": 25.0,
        "p90": 79.0,
        "p99": 97.9,
    }
    assert s["trainable"]["mean"] == 20.0
    # bucket batch size = min(max_batch_size=4, token_budget=128 // upper)
    assert [
        (b["lower"], b["upper"], b["rows"], b["batch_size"], b["batches"]) for b in s["buckets"]
    ] == [(0, 16, 1, 4, 1), (16, 64, 2, 2, 1), (64, 128, 1, 1, 1)]
    assert s["buckets"][1]["fill"] == pytest.approx(50 / 128, abs=1e-4)
    assert s["batches_per_epoch"] == 3
    assert s["longest_bucket_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["histogram"]["bin_width"] == 4
    assert sum(s["histogram"]["counts"].values()) == 4


def test_drift_reports_change_in_percent():
    old = stats_for([10, 20, 30, 100], [5, 10, 15, 50])
    new = stats_for([10, 20, 100, 100, 120], [5, 10, 50, 50, 60])
    d = drift(old, new)
    assert d["mean length"]["old"] == 40.0 and d["mean length"]["new"] == 70.0
    assert d["mean length"]["change_pct"] == 75.0
    assert d["mean length"]["line"] == "mean length 40 -> 70, +75.0 %"
    assert d["longest-bucket share"]["line"] == "longest-bucket share 33 % -> 60 %"


def test_statistics_per_domain_from_the_expanded_rows(tmp_path):
    """Each domain's rows, tokens and share of trainable tokens; a row the expanded file does not
    label is `unknown`, not dropped."""
    from dflash.data.stats import domain_stats, with_domains
    from dflash.eval.report import _domains

    tokenized = pl.DataFrame(
        {"id": ["a", "b", "c", "d"], "length": [10, 20, 30, 40], "trainable": [5, 10, 15, 20]}
    )
    expanded = tmp_path / "train.parquet"
    pl.DataFrame({"id": ["a", "b", "c"], "domain": ["code", "chat", "code"]}).write_parquet(
        expanded
    )
    s = domain_stats(with_domains(tokenized, expanded))
    assert list(s) == ["chat", "code", "unknown"]
    assert s["code"]["rows"] == 2 and s["code"]["tokens"] == 40
    assert s["code"]["trainable_tokens"] == 20 and s["code"]["trainable_share"] == 0.4
    assert s["code"]["length"]["mean"] == 20.0 and s["unknown"]["length"]["max"] == 40
    assert sum(d["rows"] for d in s.values()) == tokenized.height
    # summary.md's data line names each domain's rows and share of the trainable tokens
    line = _domains({"domains": s})
    assert line == (
        "; by domain: chat 1 rows (20 % of trainable tokens), code 2 rows (40 % of trainable"
        " tokens), unknown 1 rows (40 % of trainable tokens)"
    )
    assert _domains({}) == ""
