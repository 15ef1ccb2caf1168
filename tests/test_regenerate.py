"""A killed regeneration resumes without losing or duplicating a row, and matches a clean run."""

import hashlib
import json
import signal
import subprocess
import sys
import time

import polars as pl
import pytest

from dflash.data.regenerate import in_shard

pytestmark = pytest.mark.slow

CONFIG = json.dumps(
    {"data": {"regenerate": {"max_new_tokens": 24, "batch_size": 2, "dtype": "bfloat16"}}}
)


def regenerate(target, rows, out, workdir, **popen):
    cmd = [
        sys.executable,
        "-m",
        "dflash",
        "regenerate",
        "--config",
        CONFIG,
        "--target",
        str(target),
        "--input",
        str(rows),
        "--output",
        str(out),
        "--workdir",
        str(workdir),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)


def test_killed_run_resumes_without_loss_or_duplication(tiny_workflow, target_dir, tmp_path):
    rows = tiny_workflow.results / "data" / "expanded" / "train.parquet"
    assert pl.read_parquet(rows).height == 6  # three batches of two

    clean = regenerate(target_dir, rows, tmp_path / "clean.parquet", tmp_path / "w1")
    assert clean.wait() == 0, clean.stderr.read()

    run = regenerate(target_dir, rows, tmp_path / "resumed.parquet", tmp_path / "w2")
    deadline = time.time() + 300
    while not list((tmp_path / "w2").rglob("batch-00000.jsonl")) and time.time() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    finished = sorted(p.name for p in (tmp_path / "w2").rglob("batch-*.jsonl"))
    assert finished and len(finished) < 3, f"kill came too late to test resume: {finished}"
    assert not (tmp_path / "resumed.parquet").exists()

    resumed = regenerate(target_dir, rows, tmp_path / "resumed.parquet", tmp_path / "w2")
    assert resumed.wait() == 0, resumed.stderr.read()
    a = pl.read_parquet(tmp_path / "clean.parquet")
    b = pl.read_parquet(tmp_path / "resumed.parquet")
    assert b["id"].n_unique() == b.height == 6
    assert a["id"].to_list() == pl.read_parquet(rows)["id"].to_list()
    assert a.equals(b)
    # The target really rewrote the answers: they differ from ShareGPT's originals.
    original = pl.read_parquet(rows)["conversations"].to_list()
    regenerated = a["conversations"].to_list()
    assert any(
        o[-1]["content"] != r[-1]["content"] for o, r in zip(original, regenerated, strict=True)
    )


def test_shards_partition_rows_by_id():
    ids = [hashlib.sha256(str(i).encode()).hexdigest()[:20] for i in range(300)]
    owners = [[s for s in range(3) if in_shard(i, s, 3)] for i in ids]
    assert all(len(o) == 1 for o in owners)
    assert {o[0] for o in owners} == {0, 1, 2}


def test_generated_ids_are_stored_and_match_the_text(tiny_workflow, tokenizer):
    frame = pl.read_parquet(tiny_workflow.results / "data/regenerated/train.parquet")
    stop = tokenizer.eos_token_id
    for row in frame.iter_rows(named=True):
        answers = [t["content"] for t in row["conversations"] if t["role"] == "assistant"]
        assert len(row["turn_token_ids"]) == len(answers)
        for ids, text in zip(row["turn_token_ids"], answers, strict=True):
            content = ids[:-1] if ids and ids[-1] == stop else ids
            assert tokenizer.decode(content, skip_special_tokens=True) == text
    tokenized = pl.read_parquet(tiny_workflow.results / "data/tokenized/train.parquet")
    uncut = tokenized.filter(pl.col("length") < 96)  # tiny.yaml max_length: not truncated
    assert uncut.height > 0
    for row in uncut.iter_rows(named=True):
        last = frame.filter(pl.col("id") == row["id"]).row(0, named=True)["turn_token_ids"][-1]
        assert row["input_ids"][-len(last) :] == last  # exactly as generated
