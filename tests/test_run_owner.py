"""A run's folder belongs to its config (dflash/run_owner.py): a command whose config makes
something else than the run in `results` is refused before any job, naming both configs and
what to do; the run's own config files, edited, are the same run; keys that change no output do
not count. The workflow-level case (a command without --configfile over one's own finished run)
is in test_own_model."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import REPO

from dflash import preflight, run_owner
from dflash.config import load_config
from dflash.errors import UserError


@pytest.fixture
def own(tmp_path):
    config = load_config(REPO / "config/my-model.yaml")
    config["results"] = str(tmp_path / "results")
    return config


def test_a_command_of_another_config_is_refused_naming_both(own, tmp_path):
    results = tmp_path / "results"
    run_owner.record(own, ["config/my-model-cpu.yaml"], results)
    default = load_config(REPO / "config/config.yaml")
    with pytest.raises(UserError) as e:
        run_owner.check(default, [], results)
    message = str(e.value)
    assert "\n" not in message
    assert f"{results}/ holds a run of config/my-model-cpu.yaml" in message
    assert "this command's config (the embedded default (config/config.yaml))" in message
    assert "target.gguf_wheel: null -> " in message and "target.path: " in message
    assert "give it --configfile config/my-model-cpu.yaml" in message
    assert "set `results:` in your config to another folder" in message
    assert "--config overwrite_results=true" in message
    # told otherwise
    assert run_owner.check(dict(default, overwrite_results="true"), [], results) is None


def test_the_runs_own_config_files_edited_are_the_same_run(own, tmp_path):
    results = tmp_path / "results"
    run_owner.record(own, ["my.yaml"], results)
    edited = copy.deepcopy(own)
    edited["train"]["epochs"] = 3
    note = run_owner.check(edited, ["my.yaml"], results)
    assert "changed since: train.epochs: 2 -> 3" in note
    with pytest.raises(UserError, match="train.epochs: 2 -> 3"):
        run_owner.check(edited, ["other.yaml"], results)  # another file: another config


def test_keys_that_make_nothing_else_and_auto_sizes_do_not_count(own, tmp_path):
    results = tmp_path / "results"
    resolved = copy.deepcopy(own)
    resolved["data"]["token_budget"], resolved["drafter"]["max_anchors"] = 4096, 8
    run_owner.record(resolved, ["a.yaml"], results)
    other = copy.deepcopy(own)  # token_budget: auto, as the config file says
    other["train"]["tensorboard"] = False
    other["train"]["topology"] = {"targets": 1, "drafters": 1, "target_shards": 1}
    other["data"]["regenerate"]["batch_size"] = 8
    other["eval"]["max_prompts"] = 3  # evaluation: what it measures, not what the run is
    assert run_owner.check(other, ["b.yaml"], results) is None


def test_a_finished_run_from_before_the_record_is_read_from_its_manifest(own, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "MANIFEST.json").write_text(json.dumps({"config": own}))
    assert run_owner.check(copy.deepcopy(own), ["x.yaml"], results) is None
    with pytest.raises(UserError, match="holds a run of a config its MANIFEST.json holds"):
        run_owner.check(load_config(REPO / "config/config.yaml"), [], results)


def test_preflight_refuses_before_any_job_but_lets_unlock_through(own, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my-chats.jsonl").write_text("{}\n")
    run_owner.record(own, ["mine.yaml"], tmp_path / "results")
    default = load_config(REPO / "config/config.yaml")
    default["results"] = "results"
    with pytest.raises(UserError, match="holds a run of mine.yaml"):
        preflight.results_belong_to_this_config(preflight.Run(default, workdir=tmp_path))
    unlock = preflight.Run(default, workdir=tmp_path, unlocking=True)
    assert preflight.results_belong_to_this_config(unlock) is None
