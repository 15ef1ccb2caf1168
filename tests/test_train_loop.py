"""Single-process training: a run killed after a checkpoint resumes to the very same weights."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dflash.io import sha256_file

pytestmark = pytest.mark.slow

CONFIG = {
    "seed": 0,
    "target": {"mask_token_id": 3},
    "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 4},
    "compile": {"enabled": False},
    "data": {"buckets": [32, 64], "max_length": 96, "token_budget": 128, "max_batch_size": 2},
    "train": {"epochs": 2, "checkpoint_every": 1, "keep_checkpoints": 20, "lr": 1e-3},
}


def train(tiny_workflow, target_dir, out, config=CONFIG):
    data = tiny_workflow.results / "data/tokenized/train.parquet"
    cmd = [
        sys.executable,
        "-m",
        "dflash",
        "train",
        "--config",
        json.dumps(config),
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--out",
        str(out / "drafter"),
        "--metrics",
        str(out / "metrics.jsonl"),
        "--checkpoints",
        str(out / "ckpt"),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps(path):
    return [
        {k: r[k] for k in ("step", "epoch", "batch", "loss", "tau")}
        for r in map(json.loads, path.read_text().splitlines())
    ]


@pytest.fixture(scope="module")
def clean_run(tiny_workflow, target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    run = train(tiny_workflow, target_dir, out)
    assert run.wait() == 0, run.stderr.read()[-3000:]
    return out


def test_resume_after_kill_gives_identical_weights_and_metrics(
    tiny_workflow, target_dir, clean_run, tmp_path
):
    expected = steps(clean_run / "metrics.jsonl")
    assert [r["step"] for r in expected] == list(range(1, len(expected) + 1))
    assert len(expected) >= 4 and {r["epoch"] for r in expected} == {0, 1}

    run = train(tiny_workflow, target_dir, tmp_path / "resumed")
    deadline = time.time() + 300
    while not (tmp_path / "resumed/ckpt/step-00000002").exists() and time.time() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert not (tmp_path / "resumed/drafter").exists()
    again = train(tiny_workflow, target_dir, tmp_path / "resumed")
    assert again.wait() == 0, again.stderr.read()[-3000:]
    assert steps(tmp_path / "resumed" / "metrics.jsonl") == expected
    assert sha256_file(tmp_path / "resumed/drafter/model.safetensors") == sha256_file(
        clean_run / "drafter/model.safetensors"
    )


def test_resume_refuses_a_changed_run(tiny_workflow, target_dir, clean_run, tmp_path):
    shutil.copytree(clean_run / "ckpt", tmp_path / "ckpt")
    changed = json.loads(json.dumps(CONFIG))
    changed["drafter"]["gamma"] = 2.0
    done = train(tiny_workflow, target_dir, tmp_path, changed)
    assert done.wait() == 1
    assert "gamma: checkpoint 4.0 != now 2.0" in done.stderr.read()
