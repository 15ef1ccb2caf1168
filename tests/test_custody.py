"""Chain of custody (dflash.custody): no stage reads, and `record` never blesses, a file that
differs from what its producer wrote; Snakemake rebuilds a damaged output before anything reads
it; `verify` and `compare` refuse a run record that is not one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from conftest import Workflow

from dflash.cli import main
from dflash.io import sha256_file

RECORD = {"format": 1, "code": {}, "environment": {}, "config": {}, "artefacts": {}}


@pytest.mark.parametrize(
    "text, says",
    [
        (json.dumps(RECORD)[:30], "not valid JSON"),  # cut short
        ("", "not valid JSON"),
        ("{}", "lacks the key(s) format, code, environment, config, artefacts"),
        ("[]", "holds no JSON object"),
        (json.dumps(RECORD | {"artefacts": ["train.parquet"]}), "'artefacts' must map files"),
    ],
    ids=["truncated", "empty-file", "empty-object", "list", "artefacts-not-a-map"],
)
def test_verify_and_compare_refuse_a_malformed_record_naming_it(tmp_path, capsys, text, says):
    bad = tmp_path / "results" / "MANIFEST.json"
    bad.parent.mkdir()
    bad.write_text(text)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(RECORD))
    for argv in (["verify", str(bad.parent)], ["compare", str(good), str(bad)]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"{bad} is not a run record" in err and says in err, err
        assert err.count("\n") == 1, err  # one paragraph, no traceback


def flip_a_bit_that_still_parses(path: Path) -> bytes:
    """Flip one bit of a parquet file so that it still reads, as different rows (about one
    flip in five does); return the original bytes."""
    original, rows = path.read_bytes(), pl.read_parquet(path)
    for i in range(len(original) // 3, len(original)):  # column data, past the header
        flipped = bytearray(original)
        flipped[i] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            if not pl.read_parquet(path).equals(rows):
                return original
        except Exception:  # this flip breaks the file: try the next
            continue
    raise AssertionError(f"no single-bit flip of {path} still parses")


TOKENIZED = ("data/tokenized/train.parquet", "data/tokenized/train.report.json")


@pytest.fixture
def tokenized(tiny_workflow, tmp_path, monkeypatch) -> Path:
    """A copy of the tiny run's tokenized training split, its report and their stage manifest,
    at the paths the manifest names (relative to the working directory, here tmp_path)."""
    for rel in (*TOKENIZED, "manifests/tokenize_train.json"):
        (tmp_path / "results" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tiny_workflow.results / rel, tmp_path / "results" / rel)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "results/data/tokenized/train.parquet"


@pytest.mark.slow
def test_a_stage_refuses_an_input_changed_since_its_producer_wrote_it(tokenized, capsys):
    recorded = sha256_file(tokenized)
    original = flip_a_bit_that_still_parses(tokenized)
    stats = ["stats", "--config", "{}", "--input", "results/data/tokenized/train.parquet"]
    stats += ["--json", "results/data/stats/stats.json", "--plot", "results/data/stats/s.png"]
    stats += ["--manifest", "results/manifests/length_stats.json"]
    assert main(stats) == 1
    err = capsys.readouterr().err
    assert "an input is not what its producer wrote: results/data/tokenized/train.parquet" in err
    assert recorded in err and sha256_file(tokenized) in err and "tokenize_train.json" in err
    assert not Path("results/data/stats").exists()  # nothing was run
    tokenized.write_bytes(original)  # the bytes its producer wrote: the same stage runs
    assert main(stats) == 0
    assert Path("results/data/stats/stats.json").is_file()


@pytest.mark.slow
def test_record_refuses_to_bless_a_file_its_stage_did_not_write(tokenized, capsys):
    recorded = sha256_file(tokenized)
    original = flip_a_bit_that_still_parses(tokenized)
    record = ["record", "--config", "{}", "--results", "results"]
    record += ["--output", "results/MANIFEST.json", "results/manifests/tokenize_train.json"]
    record += [f"results/{rel}" for rel in TOKENIZED]
    assert main(record) == 1
    err = capsys.readouterr().err
    assert "refusing to record" in err and "results/data/tokenized/train.parquet" in err
    assert recorded in err and sha256_file(tokenized) in err
    assert not Path("results/MANIFEST.json").exists()
    tokenized.write_bytes(original)
    assert main(record) == 0
    artefacts = json.loads(Path("results/MANIFEST.json").read_text())["artefacts"]
    assert artefacts["data/tokenized/train.parquet"] == recorded


def copy_run(flow: Workflow, work: Path) -> Workflow:
    """A copy of a run's folder (.snakemake included) reading the same converted target."""
    skip = shutil.ignore_patterns("results-*", "resources")
    shutil.copytree(flow.workdir, work, ignore=skip)
    (work / "resources").symlink_to(flow.workdir / "resources")
    return Workflow(flow.repo, work)


@pytest.mark.slow
def test_a_flipped_bit_in_a_tokenized_parquet_is_rebuilt_before_its_consumer_reads_it(
    tiny_workflow, tmp_path
):
    """The issue's case: a bit flip that still parses. Snakemake alone retrained on it and
    blessed it; now the planning names it, moves it aside, and tokenize writes it again."""
    flow = copy_run(tiny_workflow, tmp_path / "work")
    parquet = flow.results / "data/tokenized/train.parquet"
    stats = flow.results / "data/stats/stats.json"
    good, good_stats = sha256_file(parquet), stats.read_bytes()
    flip_a_bit_that_still_parses(parquet)
    flipped = parquet.read_bytes()
    done = flow.run("stats")  # up to the rule that reads it, no further
    log = done.stdout + done.stderr
    assert "results/data/tokenized/train.parquet is not what its producer wrote" in log
    assert "rule tokenize:" in log and "rule length_stats:" in log
    assert sha256_file(parquet) == good
    assert stats.read_bytes() == good_stats  # its consumer read the rebuilt rows
    assert (flow.results / "work/damaged/data/tokenized/train.parquet").read_bytes() == flipped


@pytest.mark.slow
def test_a_truncated_drafter_is_trained_again_before_the_evaluation_reads_it(
    tiny_workflow, tmp_path
):
    """The evaluation died on it with a traceback naming no file, and train was never planned
    again: now a dry run names it and plans train before both evaluations."""
    tiny_workflow.run("train")  # nothing to do when test_workflow has trained
    flow = copy_run(tiny_workflow, tmp_path / "work")
    weights = flow.results / "drafter/model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    done = flow.run("-n", "all")
    log = done.stdout + done.stderr
    assert "results/drafter/model.safetensors is not what its producer wrote" in log
    assert "recorded sha256" in log and "manifests/train.json" in log
    assert not weights.exists()
    assert (flow.results / "work/damaged/drafter/model.safetensors").stat().st_size == size // 2
    # until train has made it again, every target asks for it: the next dry run plans it too
    planned = flow.planned_jobs("all")
    assert {"train", "eval_acceptance", "eval_ddtree", "record"} <= planned.keys()
    assert "train" in flow.planned_jobs("data")


@pytest.mark.slow
def test_a_hand_edited_summary_is_made_again_and_never_recorded(tiny_workflow, tmp_path):
    """`report` keeps a stage manifest like every stage: an edited summary.md is named at the
    next planning, moved aside and written again by report, so the record never holds it and
    `verify` passes again."""
    tiny_workflow.run("all")
    flow = copy_run(tiny_workflow, tmp_path / "work")
    summary = flow.results / "summary.md"
    good = summary.read_bytes()
    summary.write_text(good.decode().replace("τ = ", "τ = 9", 1))
    done = flow.run("all")
    log = done.stdout + done.stderr
    assert "results/summary.md is not what its producer wrote" in log
    assert "rule report:" in log
    assert summary.read_bytes() == good
    assert flow.run("verify").returncode == 0


@pytest.mark.slow
def test_a_cut_short_run_record_is_made_again_by_the_command_verify_gives(tiny_workflow, tmp_path):
    tiny_workflow.run("all")
    flow = copy_run(tiny_workflow, tmp_path / "work")
    record = flow.results / "MANIFEST.json"
    cut = record.read_bytes()[:100]
    record.write_bytes(cut)
    done = flow.run("verify", check=False)
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "is not a run record" in said
    assert "`snakemake --cores all all` writes it again" in said
    log = flow.run("all")  # the command the message gives
    assert "rule record:" in log.stdout + log.stderr
    assert flow.run("verify").returncode == 0
    assert (flow.results / "work/damaged/MANIFEST.json").read_bytes() == cut  # kept for a look
