"""The pre-job checks (dflash/preflight.py), called directly as the Snakefile calls them: each
refusal names the key or the file, and a note is returned, not raised. The workflow-level cases
(a user's target without a mask token, a misfit drafter.init) run in test_workflow."""

import os
import sys

import pytest
import yaml
from conftest import TESTS

from dflash import preflight
from dflash.errors import UserError


def tiny(tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local.jsonl").write_text((TESTS / "data" / "local.jsonl").read_text())
    return yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())


def test_a_valid_config_passes_with_its_nested_defaults_filled(tmp_path, monkeypatch):
    config = tiny(tmp_path, monkeypatch)
    assert preflight.run(config) == []
    assert config["data"]["regenerate"]["engine"] == "auto"  # a nested default, filled in place


def test_a_config_error_names_the_key(tmp_path, monkeypatch):
    config = tiny(tmp_path, monkeypatch)
    config["data"]["sources"][1]["path"] = "gone.jsonl"
    with pytest.raises(UserError, match=r"data.sources\[1\].path: gone.jsonl: no such file"):
        preflight.run(config)
    config = tiny(tmp_path, monkeypatch)
    config["train"]["lr"] = -1
    with pytest.raises(UserError, match=r"train.lr: -1 is less than or equal to"):
        preflight.run(config)


def test_a_python_that_is_not_its_environment_s_python_is_refused(tmp_path, monkeypatch):
    """The rules call `python` from the folder of the Python running Snakemake."""
    config = tiny(tmp_path, monkeypatch)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").symlink_to(sys.executable)
    with pytest.raises(UserError, match=r"bin/python is not the Python running Snakemake"):
        preflight.run(config, python=str(tmp_path / "bin" / "python3"))
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    assert preflight.run(config, python=str(tmp_path / "bin" / "python3")) == []


def test_locks_left_behind_are_a_note_in_the_planning_process_only(tmp_path, monkeypatch):
    config = tiny(tmp_path, monkeypatch)
    locks = tmp_path / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("x")
    (note,) = preflight.run(config)
    assert "a run this workflow did not record" in note
    assert preflight.run(config, main_process=False) == []


def test_drafter_init_at_the_drafter_this_run_writes_is_refused(tmp_path, monkeypatch):
    config = tiny(tmp_path, monkeypatch)
    config["drafter"]["init"] = "results/drafter"
    with pytest.raises(UserError, match="is the drafter this run writes"):
        preflight.run(config)
    config["drafter"]["init"] = "drafters/none"
    with pytest.raises(UserError, match="drafter.init: drafters/none: no such directory"):
        preflight.run(config)


def test_a_check_added_to_the_list_runs_in_order_and_its_note_is_returned(tmp_path, monkeypatch):
    config = tiny(tmp_path, monkeypatch)
    seen = []

    def check_defaults_are_there(run: preflight.Run) -> str:
        seen.append(run.config["data"]["regenerate"]["engine"])
        return f"results in {os.fspath(run.results)}"

    monkeypatch.setattr(preflight, "CHECKS", [*preflight.CHECKS, check_defaults_are_there])
    assert preflight.run(config) == ["results in results"]
    assert seen == ["auto"]
