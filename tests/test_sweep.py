"""bench/sweep.py: a variant that trains on a share of the rows (issue 57's τ against compute)
takes exactly the rows `expand` keeps for that share, from the base folder's own rows."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sweep", REPO / "bench/sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def expand(workdir: Path, config: Path, out: Path) -> None:
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "dflash", "expand", "--config", str(config)]
    command += ["--train", str(out / "train.parquet"), "--eval", str(out / "eval.parquet")]
    command += ["--report", str(out / "report.json")]
    subprocess.run(command, cwd=workdir, check=True, capture_output=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict]:
    """A base results folder whose expanded rows are the real `expand`'s on the tiny config (its
    training rows raised so that shares differ, the chat rows capped, two sampled answers a
    prompt) and whose tokenized rows stand for each row's own tokens."""
    root = tmp_path_factory.mktemp("sweep")
    shutil.copy(REPO / "tests/data/local.jsonl", root)
    config = yaml.safe_load((REPO / "tests/data/tiny.yaml").read_text())
    config["data"]["train_rows"] = None
    config["data"]["domain_rows"] = {"chat": 40}  # of its 80 chat rows; 4 code, 1 math
    config["data"]["regenerate"] |= {"temperature": 0.7, "samples": 2}
    (root / "base.yaml").write_text(yaml.safe_dump(config))
    expand(root, root / "base.yaml", root / "results/data/expanded")
    ids = pl.read_parquet(root / "results/data/expanded/train.parquet")["id"].to_list()
    tokenized = root / "results/data/tokenized"
    tokenized.mkdir(parents=True)
    frame = pl.DataFrame({"id": ids, "input_ids": [[k, k + 1] for k in range(len(ids))]})
    frame.write_parquet(tokenized / "train.parquet")
    frame.head(2).write_parquet(tokenized / "eval.parquet")
    return root, config


SHARES = {
    "a quarter": {"train_fraction": 0.25},
    "chat only, halved": {"domain_rows": {"chat": 20, "code": 0, "math": 0}, "train_fraction": 0.5},
    "six rows": {"train_rows": 6},
}


@pytest.mark.parametrize("share", SHARES, ids=list(SHARES))
def test_a_share_of_the_rows_is_what_expand_keeps_for_that_share(base, share):
    root, config = base
    config = {**config, "data": {**config["data"], **SHARES[share]}}
    name = share.replace(" ", "-").replace(",", "")
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    expand(root, root / f"{name}.yaml", root / name)  # the share, expanded for real
    wanted = pl.read_parquet(root / name / "train.parquet")["id"].to_list()
    results = root / "results"
    base_config = yaml.safe_load((root / "base.yaml").read_text())

    prompts = sweep.subset_data(results, results / "sweep" / name, base_config, config)

    data = results / "sweep" / name / "data"
    assert 2 * prompts == len(wanted) > 0  # each prompt and its second sampled answer
    assert pl.read_parquet(data / "expanded/train.parquet")["id"].to_list() == wanted
    base_tokenized = pl.read_parquet(results / "data/tokenized/train.parquet")
    kept = base_tokenized.filter(pl.col("id").is_in(wanted))  # the base's own, in its order
    assert pl.read_parquet(data / "tokenized/train.parquet").equals(kept)
    for split in ("expanded", "tokenized"):
        assert (
            data / split / "eval.parquet"
        ).resolve() == results / "data" / split / "eval.parquet"
    report = json.loads((data / "expanded/report.json").read_text())
    expanded = json.loads((root / name / "report.json").read_text())
    for key in ("train_rows", "train_prompts"):
        assert report[key] == expanded[key]
    assert report["domains"]["train"] == expanded["domains"]["train"]
    assert not (results / "sweep" / name / "data.partial").exists()


def test_a_variant_whose_rows_the_base_lacks_is_refused(base):
    root, config = base
    results, data = root / "results", config["data"]
    refused = {  # base's data keys, the variant's: each would keep rows the base left out
        "train_fraction 0.5 there": ({"train_fraction": 0.5}, {"train_fraction": 0.25}),
        "train_rows is 4 there, the variant asks None": ({"train_rows": 4}, {"train_rows": None}),
        "train_rows is 4 there, the variant asks 5": ({"train_rows": 4}, {"train_rows": 5}),
        "caps chat there": ({}, {"domain_rows": {"chat": 60}}),
        "train_rows is 4 there, and the variant changes": (
            {"train_rows": 4},
            {"domain_rows": {"chat": 2}},
        ),
    }
    for why, (base_data, variant) in refused.items():
        base_config = {**config, "data": {**data, **base_data}}
        variant_config = {**config, "data": {**data, **base_data, **variant}}
        with pytest.raises(SystemExit, match=why):
            sweep.subset_data(results, root / "other", base_config, variant_config)
    # other keys make other rows, not a share of these
    for key, value in (("seed", 1), ("data.regenerate.samples", 1), ("data.max_chars", 100)):
        variant = sweep.with_overrides(yaml.safe_load(yaml.safe_dump(config)), [f"{key}={value}"])
        variant["data"]["train_fraction"] = 0.5
        with pytest.raises(SystemExit, match=rf"changes .*{re.escape(key)}"):
            sweep.subset_data(results, root / "other", config, variant)
    assert not (root / "other").exists()


def test_a_fine_tune_from_a_sibling_starts_once_its_training_ends_and_not_if_it_failed(tmp_path):
    config = {"drafter": {"init": "sweep:chat"}}
    sibling = sweep.after_sibling(config, tmp_path)
    assert sibling == tmp_path / "sweep/chat"
    assert config["drafter"]["init"] == str(tmp_path / "sweep/chat/drafter")
    assert sweep.after_sibling({"drafter": {"init": "random"}}, tmp_path) is None

    (sibling / "train").mkdir(parents=True)
    ran = tmp_path / "ran"
    command = sweep.waiting_for(sibling, ["bash", "-c", f"echo ran > {ran}"])
    waiting = subprocess.Popen(command)
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=3)  # the sibling is still training
    assert not ran.exists()
    (sibling / "train/summary.json").write_text("{}")
    assert waiting.wait(timeout=10) == 0 and ran.read_text() == "ran\n"

    ran.unlink()
    (sibling / "train/summary.json").unlink()
    (sibling / "sweep.log").write_text("train: start 10:00:00\ntrain: FAILED\n")
    assert subprocess.run(command, capture_output=True, timeout=10).returncode == 1
    assert not ran.exists()


def test_a_variant_started_again_takes_the_share_it_names_now(base, monkeypatch):
    root, config = base
    results = root / "results"
    started = []
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda command, **_: started.append(command))
    (results / "target").mkdir(exist_ok=True)

    def start(*pairs: str) -> Path:
        argv = ["sweep.py", "start", "--config", str(root / "base.yaml"), "--results", str(results)]
        monkeypatch.setattr(sys, "argv", [*argv, "--variant", "v", *pairs])
        sweep.main()
        return results / "sweep/v/data"

    quarter = start("data.train_fraction=0.25")
    rows = json.loads((quarter / "expanded/report.json").read_text())["train_prompts"]
    half = start("data.train_fraction=0.5")
    assert json.loads((half / "expanded/report.json").read_text())["train_prompts"] > rows
    assert start("train.lr=1e-3").resolve() == results / "data"  # no share: the base's rows
    assert len(started) == 3
