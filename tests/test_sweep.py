"""bench/sweep.py: a variant that trains on a share of the rows (issue 57's τ against compute)
takes exactly the rows `expand` keeps for that share, from the base folder's own rows."""

from __future__ import annotations

import importlib.util
import json
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
    training rows raised so that shares differ) and whose tokenized rows stand for each row's
    own tokens, with a sampled copy of one row."""
    root = tmp_path_factory.mktemp("sweep")
    shutil.copy(REPO / "tests/data/local.jsonl", root)
    config = yaml.safe_load((REPO / "tests/data/tiny.yaml").read_text())
    config["data"]["train_rows"] = None
    (root / "base.yaml").write_text(yaml.safe_dump(config))
    expand(root, root / "base.yaml", root / "results/data/expanded")
    ids = pl.read_parquet(root / "results/data/expanded/train.parquet")["id"].to_list()
    ids.insert(1, f"{ids[0]}-s1")  # `data.regenerate.samples`: a copy follows its row
    tokenized = root / "results/data/tokenized"
    tokenized.mkdir(parents=True)
    frame = pl.DataFrame({"id": ids, "input_ids": [[k, k + 1] for k in range(len(ids))]})
    frame.write_parquet(tokenized / "train.parquet")
    frame.head(2).write_parquet(tokenized / "eval.parquet")
    return root, config


def test_a_share_of_the_rows_is_what_expand_keeps_for_that_share(base):
    root, config = base
    config = {**config, "data": {**config["data"], "train_fraction": 0.25}}
    (root / "quarter.yaml").write_text(yaml.safe_dump(config))
    expand(root, root / "quarter.yaml", root / "quarter")  # the share, expanded for real
    wanted = pl.read_parquet(root / "quarter/train.parquet")["id"].to_list()
    results = root / "results"
    base_config = yaml.safe_load((root / "base.yaml").read_text())

    rows = sweep.subset_data(results, results / "sweep/q", base_config["data"], config["data"])

    data = results / "sweep/q/data"
    assert rows == len(wanted) > 0
    assert pl.read_parquet(data / "expanded/train.parquet")["id"].to_list() == wanted
    base_tokenized = pl.read_parquet(results / "data/tokenized/train.parquet")
    # the base's own tokens of those rows, in its order, the sampled copy with its row
    kept = base_tokenized.filter(pl.col("id").is_in([*wanted, f"{wanted[0]}-s1"]))
    assert kept.height == len(wanted) + 1
    assert pl.read_parquet(data / "tokenized/train.parquet").equals(kept)
    assert (data / "tokenized/eval.parquet").resolve() == results / "data/tokenized/eval.parquet"
    report = json.loads((data / "expanded/report.json").read_text())
    assert report["train_rows"] == len(wanted)
    assert report["subset_of"]["train_fraction"] == 0.25


def test_a_share_of_a_base_that_holds_a_share_is_refused(base):
    root, config = base
    results = root / "results"
    half = {**config["data"], "train_fraction": 0.5}
    with pytest.raises(SystemExit, match="a share of rows the base has"):
        sweep.subset_data(results, root / "other", half, {**half, "train_fraction": 0.25})
    rows = {**config["data"], "train_rows": 4}
    with pytest.raises(SystemExit, match="data.train_rows 4"):
        sweep.subset_data(results, root / "other", rows, {**rows, "train_rows": None})
