"""The run record, `verify` and `compare`, on two real full runs of the tiny config."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from conftest import OVER, Workflow

from dflash.compare import compare, load_run
from dflash.record import VOLATILE, data_summary

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_a(tiny_workflow) -> Workflow:
    tiny_workflow.run("all")
    return tiny_workflow


@pytest.fixture(scope="module")
def run_b(run_a, second_workflow) -> Workflow:
    """conftest's second full run from scratch: same code, config and environment, another
    folder."""
    return second_workflow


def record(flow: Workflow) -> dict:
    return json.loads((flow.results / "MANIFEST.json").read_text())


def without(record: dict, dotted_paths) -> dict:
    record = copy.deepcopy(record)
    for dotted in dotted_paths:
        head, _, leaf = dotted.partition(".")
        node, key = record, head
        if leaf:  # "artefacts.train/summary.json": artefact names contain dots, so split once
            node, key = record.get(head, {}), leaf
        node.pop(key, None)
    return record


def dflash(flow: Workflow, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash", *args],
        capture_output=True,
        text=True,
        env=flow.env(),
        cwd=flow.workdir,
    )


def test_two_full_runs_give_identical_records_but_for_the_volatile_fields(run_a, run_b):
    a, b = record(run_a), record(run_b)
    assert without(a, VOLATILE) == without(b, VOLATILE)
    # what the record must hold, and what must match between the runs
    assert (
        a["artefacts"]["drafter/model.safetensors"] == b["artefacts"]["drafter/model.safetensors"]
    )
    assert {"dflash/train/loop.py", "workflow/Snakefile"} <= set(a["code"]["files"])
    assert a["environment"]["torch"].startswith("2.")
    assert a["topology"] == {
        **a["config"]["train"]["topology"],
        "world": 2,
        "nnodes": 1,
        "device": "auto",
    }
    assert a["data"]["rows"] > 0 and a["train"]["result"]["steps"] > 0
    assert a["eval"]["quality"]["lossless"] == 1.0
    assert {"train", "eval_acceptance", "tokenize_train", "target"} <= set(a["stages"])
    # the converted target is an input of the run, recorded where it is (under resources/)
    target = a["inputs"]["target"]
    assert target["path"].startswith("../resources/target/SmolLM2-135M-Instruct")
    assert (run_a.results / target["path"]).resolve() == run_a.target.resolve()
    assert {"hf/model.safetensors", "target.json", "manifest.json"} <= target["sha256"].keys()
    assert target == b["inputs"]["target"]
    assert not any(rel.startswith("target/") for rel in a["artefacts"])
    # every artefact under results/ is recorded: nothing a rule writes escapes the record
    assert dflash(run_a, "verify", "results").returncode == 0


# one artefact of each kind the workflow writes, and files of the converted target it read
# (<target>: its folder under resources/)
FLIPPED = [
    "data/expanded/train.parquet",
    "data/tokenized/train.parquet",
    "data/stats/stats.json",
    "data/stats/stats.png",
    "<target>/hf/model.safetensors",
    "<target>/hf/tokenizer.json",
    "<target>/target.json",
    "drafter/model.safetensors",
    "drafter/config.json",
    "drafter/dflash.py",
    "train/metrics.jsonl",
    "eval/acceptance.json",
    "report/acceptance.png",
    "summary.md",
    "manifests/train.json",
]


@pytest.mark.parametrize("rel", FLIPPED)
def test_verify_catches_a_flipped_byte(run_a, rel):
    if rel.startswith("<target>/"):
        shown = (run_a.target / rel.split("/", 1)[1]).relative_to(run_a.workdir).as_posix()
    else:
        shown = f"results/{rel}"
    path = run_a.workdir / shown
    original = path.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    try:
        path.write_bytes(bytes(flipped))
        done = dflash(run_a, "verify", "results")
        assert done.returncode == 1
        assert f"changed  {shown}" in done.stdout
        assert "1 changed of" in done.stderr
    finally:
        path.write_bytes(original)
    assert dflash(run_a, "verify", "results").returncode == 0


def test_verify_reports_missing_and_unrecorded_files_and_the_workflow_target_fails(run_a):
    drafter = run_a.results / "drafter" / "config.json"
    moved = drafter.with_name("config.json.bak")
    drafter.rename(moved)
    try:
        done = dflash(run_a, "verify")
        assert done.returncode == 1
        assert "missing  results/drafter/config.json" in done.stdout
        assert "extra    results/drafter/config.json.bak" in done.stdout
        flow = run_a.run("verify", check=False)
        assert flow.returncode != 0 and "1 missing" in flow.stdout + flow.stderr
    finally:
        moved.rename(drafter)
    assert run_a.run("verify").returncode == 0
    # a file edited by hand (newer than the record): the target checks, it does not re-record
    # (the planning moves the edited file aside, dflash.custody: verify finds it missing)
    summary = run_a.results / "summary.md"
    original = summary.read_bytes()
    try:
        summary.write_bytes(original + b"edited by hand\n")
        flow = run_a.run("verify", check=False)
        said = flow.stdout + flow.stderr
        assert flow.returncode != 0 and "results/summary.md" in said and "1 missing" in said
    finally:
        summary.write_bytes(original)


def injected(b: dict, edit) -> dict:
    b = copy.deepcopy(b)
    edit(b)
    b["_name"] = "B (injected)"
    return b


def assert_first_cause(a: dict, b: dict, kind: str, text: str) -> dict:
    result = compare(a, same_host(a, b))
    assert result["causes"], result
    first = result["causes"][0]
    assert first["kind"] == kind, result["causes"]
    assert text in first["summary"], first
    return result


def same_host(a: dict, b: dict) -> dict:
    """B with A's host record. Two real runs on a shared machine differ in what else it did while
    each trained: a real cause, which `compare` ranks as it should (tests/test_compare.py, with
    set numbers), and which made these tests fail whenever other processes loaded the machine.
    The causes they inject are the others."""
    b = copy.deepcopy(b)
    host = (a.get("train") or {}).get("throughput", {}).get("host")
    if host is not None and "train" in b:
        b["train"]["throughput"]["host"] = copy.deepcopy(host)
    return b


def test_compare_identical_runs_finds_no_cause(run_a, run_b):
    a = load_run(run_a.results)
    result = compare(a, same_host(a, load_run(run_b.results)))
    assert result["causes"] == []
    assert result["artefacts"]["only_a"] == result["artefacts"]["only_b"] == []


def test_compare_names_an_edited_package_module_first(run_a, run_b, tmp_path):
    repo = tmp_path / "repo"  # a copy of the code that ran A and B, with one module edited
    for name in ("dflash", "workflow"):
        shutil.copytree(run_a.repo / name, repo / name)
    loop = repo / "dflash" / "train" / "loop.py"
    loop.write_text(loop.read_text() + "\n# a local experiment\n")
    edited = Workflow(repo, run_a.workdir)
    a = record(run_a)
    outputs = [f"results/{rel}" for rel in a["artefacts"]]
    done = dflash(
        edited,
        "record",
        "--config",
        json.dumps(a["config"]),
        "--results",
        "results",
        "--workflow-dir",
        str(repo / "workflow"),
        "--output",
        str(tmp_path / "MANIFEST.json"),
        *outputs,
    )
    assert done.returncode == 0, done.stderr
    b = load_run(tmp_path / "MANIFEST.json")
    result = assert_first_cause(load_run(run_b.results), b, "code", "dflash/train/loop.py")
    assert result["causes"][0]["details"] == ["changed dflash/train/loop.py"]


def test_compare_names_a_different_torch_first(run_a, run_b):
    def edit(r):
        r["environment"]["torch"] = "2.13.0+cu130"
        r["environment"]["packages"]["torch"] = "2.13.0+cu130"

    a = load_run(run_a.results)
    assert_first_cause(a, injected(load_run(run_b.results), edit), "environment", "torch")


def test_compare_names_a_changed_gamma_first(run_a, run_b):
    def edit(r):
        r["config"]["drafter"]["gamma"] = 2.0

    a = load_run(run_a.results)
    assert_first_cause(a, injected(load_run(run_b.results), edit), "config", "drafter.gamma")


def test_compare_names_a_different_drafter_count_first_and_explains_the_throughput(run_a, run_b):
    a = load_run(run_a.results)

    def edit(r):
        r["config"]["train"]["topology"]["drafters"] = 2
        r["topology"].update(drafters=2, world=3)
        # the 20K -> 11.6K story, relative to A: the two real runs' own rates differ by as much
        # as the host's load did while each trained
        r["train"]["throughput"]["tokens_per_s"] = a["train"]["throughput"]["tokens_per_s"] * 0.58

    result = assert_first_cause(a, injected(load_run(run_b.results), edit), "topology", "drafters")
    (verdict,) = result["most_likely"]  # τ did not change: one effect to explain
    assert verdict["effect"] == "throughput" and verdict["cause"] == "topology"


def test_compare_names_longer_sequences_first(run_a, run_b, tmp_path):
    # the same rows, each conversation twice as long: a real stats run on the new data
    rows = pl.read_parquet(run_a.results / "data/tokenized/train.parquet")
    longer = rows.with_columns(
        pl.concat_list("input_ids", "input_ids").alias("input_ids"),
        pl.concat_list("loss_mask", "loss_mask").alias("loss_mask"),
        (pl.col("length") * 2).alias("length"),
        (pl.col("trainable") * 2).alias("trainable"),
    )
    longer.write_parquet(tmp_path / "longer.parquet")
    cfg = {"data": {**record(run_a)["config"]["data"], "max_length": 192}}
    done = dflash(
        run_a,
        "stats",
        "--config",
        json.dumps(cfg),
        "--input",
        str(tmp_path / "longer.parquet"),
        "--json",
        str(tmp_path / "stats.json"),
        "--plot",
        str(tmp_path / "stats.png"),
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads((tmp_path / "stats.json").read_text())

    def edit(r):
        r["data"] = data_summary(stats)

    a = load_run(run_a.results)
    result = assert_first_cause(a, injected(load_run(run_b.results), edit), "data", "length")
    assert "+100.0 %" in " ".join(result["causes"][0]["details"])


def test_compare_cli_text_and_json(run_a, run_b, tmp_path):
    b = same_host(record(run_a), record(run_b))
    b["config"]["drafter"]["gamma"] = 2.0
    (tmp_path / "MANIFEST.json").write_text(json.dumps(b))
    text = dflash(run_a, "compare", "results", str(tmp_path))
    assert text.returncode == 0, text.stderr
    assert "1. config" in text.stdout and "drafter.gamma: None → 2" in text.stdout
    as_json = dflash(run_a, "compare", "results", str(tmp_path / "MANIFEST.json"), "--json")
    assert json.loads(as_json.stdout)["causes"][0]["kind"] == "config"
    bad = dflash(run_a, "compare", "results", str(Path(run_a.workdir) / "nowhere"))
    assert bad.returncode == 1 and "neither a MANIFEST.json nor a results folder" in bad.stderr


def planned(flow: Workflow, config: str = "tiny.yaml", *args: str) -> set[str]:
    return set(flow.planned_jobs("all", *args, config=config)) - {"all"}


def edited_module(flow: Workflow, rel: str, config: str = "tiny.yaml") -> set[str]:
    module = flow.repo / rel
    original = module.read_text()
    try:
        module.write_text(original + "\n# an edit\n")
        return planned(flow, config)
    finally:
        module.write_text(original)


DOWNSTREAM_OF_TRAINING = {
    "train", "eval_acceptance", "eval_ddtree", "eval_sampling", "report", "record"
}  # fmt: skip


def test_moving_the_checkout_reruns_nothing(run_a, tmp_path):
    """No rule's param holds where the checkout lives (the record's workflow folder did, as an
    absolute path): the checkout and its working directory moved together plan no job."""
    moved = tmp_path / "moved"
    skip = shutil.ignore_patterns("__pycache__", "results-*", "checkpoints")
    for name in ("repo", "work"):
        shutil.copytree(run_a.workdir.parent / name, moved / name, ignore=skip)
    assert (run_a.repo, run_a.workdir) == (
        run_a.workdir.parent / "repo",
        run_a.workdir.parent / "work",
    )
    assert Workflow(moved / "repo", moved / "work").planned_jobs("all") == {}


def test_stale_only_reruns_from_snakemakes_own_dry_run(run_a):
    import yaml

    flow = run_a
    # touch on every input and output reruns nothing, even in the worst order: each file newer
    # than the one written after it, so every output is older than its inputs
    files = [p for p in flow.workdir.rglob("*") if p.is_file() and ".snakemake" not in p.parts]
    files.sort(key=lambda p: -p.stat().st_mtime_ns)
    now = time.time_ns()
    for i, path in enumerate(files):
        os.utime(path, ns=(now + i * 10**7, now + i * 10**7))
    assert planned(flow) == set(), flow.run("-n", "all", "--quiet", "rules").stdout[-3000:]

    # an edit to an artefact's content reruns the rule that wrote it (the planning moves the
    # edited file aside: dflash.custody) and what reads it; the same bytes again, nothing
    weights = flow.results / "drafter/model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original + b" ")
    assert planned(flow) == DOWNSTREAM_OF_TRAINING
    weights.write_bytes(original)
    assert planned(flow) == set()

    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    config["train"] = {"lr": 5.0e-4}
    (flow.workdir / "lr.yaml").write_text(yaml.safe_dump(config))
    assert planned(flow, "lr.yaml", *OVER) == DOWNSTREAM_OF_TRAINING  # told: another config

    data_rules = {"expand_dataset", "regenerate_shard", "regenerate", "tokenize", "length_stats"}
    # the compile warmup's shapes come from the config, not the data: it does not rerun
    after_data = data_rules | DOWNSTREAM_OF_TRAINING
    assert edited_module(flow, "dflash/data/normalize.py") == after_data
    assert edited_module(flow, "dflash/eval/metrics.py") == {
        "eval_acceptance",
        "eval_ddtree",
        "eval_sampling",
        "report",
        "record",
    }
    assert edited_module(flow, "dflash/eval/report.py") == {"report", "record"}
    assert edited_module(flow, "dflash/compare/causes.py") == {"record"}
    assert planned(flow) == set()


def test_compare_reads_a_results_folder_without_a_record(run_a, run_b):
    """After `snakemake train` there is no MANIFEST.json yet; the stage manifests stand in."""
    manifest = run_b.results / "MANIFEST.json"
    manifest.rename(manifest.with_suffix(".bak"))
    try:
        b = load_run(run_b.results)
        assert "no MANIFEST.json" in b["_name"]
        assert b["environment"]["torch"] and "dflash/train/loop.py" in b["code"]["files"]
        a = load_run(run_a.results)
        assert compare(a, same_host(a, b))["causes"] == []  # what else the machine did: not this
    finally:
        manifest.with_suffix(".bak").rename(manifest)


def test_the_html_report_carries_the_run_record_and_the_rule_graph(run_a):
    run_a.run("--report", "report.html")
    html = (run_a.workdir / "report.html").read_text()
    assert "MANIFEST.json" in html and "Run record" in html
    # Snakemake's report draws the rule graph: its edges are in the page
    assert '"sourcerule": "train", "targetrule": "eval_acceptance"' in html


def test_a_changed_training_key_really_retrains(run_b):
    """Not only planned: the rerun trains a new run beside the finished one (last: it changes
    run B's training results; test_workflow reads only run B's data)."""
    import yaml

    config = yaml.safe_load((run_b.workdir / "tiny.yaml").read_text())
    config["train"] = {"lr": 5.0e-4}
    (run_b.workdir / "lr.yaml").write_text(yaml.safe_dump(config))
    run_b.run("train", *OVER, config="lr.yaml")  # another config file: told so
    assert len(list((run_b.results / "checkpoints").glob("run-*"))) == 2
    log = (run_b.results / "logs/train.log").read_text()
    assert "lr" in log.split("the latest differs in:")[1]
    assert run_b.planned_jobs("train", config="lr.yaml") == {}
