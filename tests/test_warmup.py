"""warmup_compile: one record per bucket shape, a cache a second process reuses, a no-op when off."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


# One bucket of 32 tokens: batches of 2 rows (64 // 32).
DATA = {"buckets": [32], "max_length": 32, "token_budget": 64, "max_batch_size": 4}


def warmup(target_dir, record, cache, enabled=True):
    config = json.dumps(
        {
            "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 2},
            "compile": {"enabled": enabled},
            "target": {"mask_token_id": 3},
            "data": DATA,
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
    cold = warmup(target_dir, tmp_path / "cold.json", tmp_path / "cache")
    # The config's bucket shape, the one compiled training pads every batch to (test_batching).
    assert [(s["batch"], s["length"]) for s in cold["shapes"]] == [(2, 32)]
    assert cold["attention"] == "sdpa" and cold["cache_files"] > 0
    warm = warmup(target_dir, tmp_path / "warm.json", tmp_path / "cache")
    # Every graph came from the cache: the warm process added no files to it.
    assert warm["cache_files"] == cold["cache_files"]


def test_training_finds_every_graph_the_warmup_compiled(tiny_workflow, tmp_path):
    """`dflash train` (its own process, imports in its own order) starts from the warmup's cache:
    its compile pass adds nothing to it. It once added every graph again (the cache keys named
    torch.memory_format after whichever module had been imported first)."""
    data = {"buckets": [96], "max_length": 96, "token_budget": 192, "max_batch_size": 4}
    config = {
        "seed": 0,
        "target": {"mask_token_id": 3},
        "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 2},
        "compile": {"enabled": True},
        "data": data,
        "train": {"epochs": 1, "topology": {"targets": 0, "drafters": 1}, "tau_sim": {"every": 0}},
    }
    target = tiny_workflow.results / "target/hf"
    cache = tmp_path / "cache"
    dflash = [sys.executable, "-m", "dflash"]
    done = subprocess.run(
        [*dflash, "warmup", "--config", json.dumps(config), "--target", str(target),
         "--record", str(tmp_path / "warmup.json"), "--cache-dir", str(cache)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    before = sorted(p for p in cache.rglob("*") if p.is_file())
    env = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    out = [f"--{k}={tmp_path / v}" for k, v in (("out", "d"), ("metrics", "m.jsonl"),
           ("summary", "s.json"), ("checkpoints", "ck"))]  # fmt: skip
    data_file = tiny_workflow.results / "data/tokenized/train.parquet"
    done = subprocess.run(
        [*dflash, "train", "--config", json.dumps(config), "--target", str(target),
         "--data", str(data_file), *out],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 1 shapes" in done.stderr
    assert sorted(p for p in cache.rglob("*") if p.is_file()) == before


def test_disabled_compile_is_a_recorded_no_op(tiny_workflow):
    tiny_workflow.run("warmup")
    record = json.loads((tiny_workflow.results / "compile/warmup.json").read_text())
    assert record["enabled"] is False and record["shapes"] == []
    assert "no" in record["note"] or "nothing" in record["note"]
