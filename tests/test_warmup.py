"""warmup_compile: one record per bucket shape, a cache a second process reuses, a no-op when off."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


# One bucket of 96 tokens (the tiny workflow's rows are up to 96 long): batches of 2 rows
# (192 // 96).
DATA = {"buckets": [96], "max_length": 96, "token_budget": 192, "max_batch_size": 4}
CONFIG = {
    "seed": 0,
    "target": {"mask_token_id": 3},
    "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 2},
    "compile": {"enabled": True},
    "data": DATA,
    "train": {"epochs": 1, "topology": {"targets": 0, "drafters": 1}, "tau_sim": {"every": 0}},
}


def warmup(target_dir, record, cache, enabled=True):
    """Cold (not from the tests' fork server): the cache keys once depended on the order of a
    process's own imports, which a served command shares with every other (the server's)."""
    config = json.dumps(CONFIG | {"compile": {"enabled": enabled}})
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
        env=os.environ | {"DFLASH_FORK_SERVER": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(record.read_text())


def cache_files(cache) -> list:
    return sorted(p for p in cache.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def cold(target_dir, tmp_path_factory):
    """One warmup into an empty cache (a cold compile takes half a minute): its record and the
    cache, which the tests below read and must leave as they found it."""
    folder = tmp_path_factory.mktemp("warmup")
    return warmup(target_dir, folder / "cold.json", folder / "cache"), folder / "cache"


def test_compiles_each_bucket_into_a_cache_that_a_second_process_reuses(cold, target_dir, tmp_path):
    record, cache = cold
    # The config's bucket shape, the one compiled training pads every batch to (test_batching).
    assert [(s["batch"], s["length"]) for s in record["shapes"]] == [(2, 96)]
    assert record["attention"] == "sdpa" and record["cache_files"] > 0
    warm = warmup(target_dir, tmp_path / "warm.json", cache)
    # Every graph came from the cache: the warm process added no files to it.
    assert warm["cache_files"] == record["cache_files"]


def test_training_finds_every_graph_the_warmup_compiled(cold, tiny_workflow, tmp_path):
    """`dflash train` (its own process, imports in its own order) starts from the warmup's cache:
    its compile pass adds nothing to it. It once added every graph again (the cache keys named
    torch.memory_format after whichever module had been imported first)."""
    _, cache = cold
    before = cache_files(cache)
    env = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "DFLASH_FORK_SERVER": "",  # its own process: its own imports, and `imports` > 0 below
    }
    out = [f"--{k}={tmp_path / v}" for k, v in (("out", "d"), ("metrics", "m.jsonl"),
           ("summary", "s.json"), ("checkpoints", "ck"))]  # fmt: skip
    target = tiny_workflow.target / "hf"
    data_file = tiny_workflow.results / "data/tokenized/train.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "dflash", "train", "--config", json.dumps(CONFIG),
         "--target", str(target), "--data", str(data_file), *out],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 1 shapes" in done.stderr
    # a graph whose cache key cannot be pickled is compiled again in every process
    assert "Failed to pickle cache key" not in done.stderr
    assert cache_files(cache) == before
    # the seconds it took are in the training summary, for the run record and `dflash compare`,
    # beside the seconds from the process's start to its first step (imports and loading too)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert isinstance(summary["compile_s"], float)
    assert summary["compile_s"] < summary["startup_s"] < 300
    # and where those seconds went, in order, adding up to them
    split = summary["startup_split_s"]
    assert sorted(split) == sorted(["imports", "setup", "resume_and_live_view", "compile"])
    assert all(v >= 0 for v in split.values()) and split["imports"] > 0
    assert abs(sum(split.values()) - summary["startup_s"]) < 0.3
    assert abs(split["compile"] - summary["compile_s"]) < 0.3


def test_disabled_compile_is_a_recorded_no_op(tiny_workflow):
    tiny_workflow.run("warmup")
    record = json.loads((tiny_workflow.results / "compile/warmup.json").read_text())
    assert record["enabled"] is False and record["shapes"] == []
    assert "no" in record["note"] or "nothing" in record["note"]


def test_memory_formats_pickle_alike_in_every_process():
    """Compile cache keys pickle torch.memory_format objects. Pickled by module lookup they named
    whichever module had imported torch first (polars in training); pickled through a reducer
    naming the torch module they could not be pickled at all, and inductor skipped caching those
    graphs ("Failed to pickle cache key" on an H200; CPU graphs hold no memory format)."""
    import pickle

    import dflash.model.step  # noqa: F401  (registers the reducer)

    for fmt in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        data = pickle.dumps(fmt)
        assert pickle.loads(data) is fmt
        assert b"dflash.model.step" in data and b"polars" not in data
