"""Faults a user causes are one paragraph naming the file, key or folder, at the earliest moment,
never a traceback: missing paths when the config is read, a mask token outside the vocabulary
before the target's conversion, a full disk in any stage."""

import errno
import json
import shutil

import polars as pl
import pytest
import yaml
from conftest import REPO, TESTS, Workflow

from dflash import cli
from dflash.config import ConfigError, check_paths, validate
from dflash.model import convert


def test_missing_input_paths_are_named_by_key_when_the_config_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "there.jsonl").write_text("{}\n")
    config = validate(
        {
            "data": {
                "sources": [
                    {"name": "a", "path": "there.jsonl"},
                    {"name": "b", "path": "gone.jsonl"},
                ]
            },
            "eval": {"sets": [{"format": "gsm8k", "path": "~/no-gsm8k-here.jsonl"}]},
            "target": {"path": "no-model-dir"},
        }
    )
    with pytest.raises(ConfigError) as caught:
        check_paths(config, "my.yaml")
    message = str(caught.value)
    assert "data.sources[1].path: gone.jsonl: no such file" in message
    assert "eval.sets[0].path: ~/no-gsm8k-here.jsonl: no such file" in message
    assert "target.path: no-model-dir: no such directory" in message
    assert "there.jsonl" not in message and str(tmp_path) in message
    assert "\n" not in message


def test_the_workflow_names_a_missing_source_and_eval_set_before_any_job(tmp_path):
    """Found while the workflow is parsed, these were FileNotFoundError tracebacks from hashing
    the files; now Snakemake's own error form: our message and where, no Python frames."""
    config = yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())
    config["data"]["sources"][1]["path"] = "missing.jsonl"
    config["eval"]["sets"] = [{"name": "gsm8k", "format": "gsm8k", "path": "gsm8k.jsonl"}]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    done = Workflow(REPO, tmp_path).run("-n", "stats", config="bad.yaml", check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "data.sources[1].path: missing.jsonl: no such file" in out
    assert "eval.sets[0].path: gsm8k.jsonl: no such file" in out
    assert "Traceback" not in out and "FileNotFoundError" not in out
    assert f'File "{REPO / "dflash"}' not in out  # no frames of the package's code
    assert not (tmp_path / "results").exists()


def gguf_target(mask_token_id):
    config = yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())
    config["target"]["mask_token_id"] = mask_token_id
    return json.dumps({"target": config["target"]})


def test_a_mask_token_outside_the_vocabulary_stops_the_target_rule_before_conversion(
    tmp_path, monkeypatch, capsys
):
    """Read off the GGUF's config alone (seconds), where it was found only after the 73 s
    conversion."""

    def convert_gguf(*args):
        raise AssertionError("the conversion started before the mask token was checked")

    monkeypatch.setattr(convert, "convert_gguf", convert_gguf)
    out = tmp_path / "hf"
    argv = ["target", "--config", gguf_target(49152), "--out", str(out)]
    assert cli.main([*argv, "--info", str(tmp_path / "target.json")]) == 1
    err = capsys.readouterr().err
    assert "target.mask_token_id=49152 is outside the vocabulary" in err
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (0..49151)" in err
    assert not out.exists()


def expand_argv(tmp_path, source):
    sources = [{"name": "s", "path": str(source)}]
    config = json.dumps({"data": {"sources": sources, "on_bad_row": "skip", "eval_rows": 1}})
    out = tmp_path / "out"
    files = ["--train", out / "train.parquet", "--eval", out / "eval.parquet"]
    return ["expand", "--config", config, *map(str, files), "--report", str(out / "report.json")]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # polars wraps it in its own exception, with the OS error in the text
        pl.exceptions.ComputeError(
            "parquet: File out of specification: underlying IO error: No space left on device"
            " (os error 28)"
        ),
    ],
)
def test_a_full_disk_names_the_folder_and_its_free_space(tmp_path, monkeypatch, capsys, error):
    source = shutil.copy(TESTS / "data" / "local.jsonl", tmp_path / "local.jsonl")

    def write_rows(rows, path):
        raise error

    monkeypatch.setattr("dflash.data.expand.write_rows", write_rows)
    assert cli.main(expand_argv(tmp_path, source)) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash expand: error: no space left on the device")
    assert f"{tmp_path / 'out'} (" in err and " free)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_other_faults_still_raise(tmp_path, monkeypatch):
    """Only a full disk is explained: a bug keeps its traceback."""
    source = shutil.copy(TESTS / "data" / "local.jsonl", tmp_path / "local.jsonl")

    def write_rows(rows, path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("dflash.data.expand.write_rows", write_rows)
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(expand_argv(tmp_path, source))


@pytest.mark.slow
def test_after_a_kill_the_next_start_says_whether_the_lock_holder_lives(tmp_path):
    """Snakemake's LockException advises --unlock, wrong while the other run is alive: a start
    beside a live run is told to wait and not to unlock; after that run is killed outright
    (kill -9 of its process group), the next start is told to unlock, and can."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import copy_repo

    repo = copy_repo(tmp_path / "repo")
    expand = repo / "dflash" / "data" / "expand.py"  # a stage that runs until it is killed
    expand.write_text(
        expand.read_text()
        .replace("    config = args.config\n", "    time.sleep(300)\n", 1)
        .replace("import logging\n", "import logging\nimport time\n", 1)
    )
    work = tmp_path / "work"
    work.mkdir()
    config = yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())
    config["data"]["sources"] = [{"name": "local", "path": "local.jsonl"}]
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(TESTS / "data" / "local.jsonl", work)
    flow = Workflow(repo, work)
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "workflow" / "Snakefile")]
    cmd += ["--cores", "1", "expand_dataset", "--configfile", "tiny.yaml"]
    first = subprocess.Popen(
        cmd,
        cwd=work,
        env=flow.env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not list((work / ".snakemake" / "dflash-runs").glob("*.json")):
            assert first.poll() is None and time.time() < deadline, "the first run never started"
            time.sleep(0.5)
        beside = flow.run("expand_dataset", check=False)
        out = beside.stdout + beside.stderr
        assert beside.returncode != 0
        assert f"a run that is still alive (snakemake pid {first.pid} on" in out
        assert "Do not run `snakemake --unlock` now" in out
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    after = flow.run("expand_dataset", check=False)
    out = after.stdout + after.stderr
    assert after.returncode != 0 and "LockException" in out
    assert f"a run that is gone (snakemake pid {first.pid} on" in out
    assert "Run `snakemake --unlock`" in out
    flow.run("--unlock")
    assert "expand_dataset" in flow.planned_jobs("expand_dataset")
