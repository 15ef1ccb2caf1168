"""warmup_compile: one record per bucket shape, a cache a second process reuses, a no-op when off."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def warmup(target_dir, stats, record, cache, enabled=True):
    config = json.dumps(
        {
            "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 2},
            "compile": {"enabled": enabled},
            "target": {"mask_token_id": 3},
        }
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash",
            "warmup",
            "--config",
            config,
            "--target",
            str(target_dir),
            "--stats",
            str(stats),
            "--record",
            str(record),
            "--cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(record.read_text())


def test_compiles_each_bucket_into_a_cache_that_a_second_process_reuses(target_dir, tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(
        json.dumps(
            {
                "buckets": [
                    {"batch_size": 2, "upper": 32, "rows": 5},
                    {"batch_size": 1, "upper": 64, "rows": 0},  # empty: nothing to compile
                ]
            }
        )
    )
    cold = warmup(target_dir, stats, tmp_path / "cold.json", tmp_path / "cache")
    assert [(s["batch"], s["length"]) for s in cold["shapes"]] == [(2, 32)]
    assert cold["attention"] == "sdpa" and cold["cache_files"] > 0
    warm = warmup(target_dir, stats, tmp_path / "warm.json", tmp_path / "cache")
    # Every graph came from the cache: the warm process added no files to it.
    assert warm["cache_files"] == cold["cache_files"]


def test_disabled_compile_is_a_recorded_no_op(tiny_workflow):
    tiny_workflow.run("warmup")
    record = json.loads((tiny_workflow.results / "compile/warmup.json").read_text())
    assert record["enabled"] is False and record["shapes"] == []
    assert "no" in record["note"] or "nothing" in record["note"]
