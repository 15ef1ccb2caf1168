"""Inputs identified by content: a user's target directory by its files' sha256 (cached, so an
unchanged one costs a stat), a hub dataset by its pinned commit."""

import os
import shutil

import pytest
import yaml
from conftest import REPO, TESTS, Workflow

from dflash import filehash
from dflash.config import ConfigError, validate
from dflash.data.expand import collect
from dflash.filehash import HashCache
from dflash.io import sha256_file


def counting(monkeypatch) -> list:
    """Every file the cache reads to hash."""
    read = []

    def sha256(path):
        read.append(os.path.basename(path))
        return sha256_file(path)

    monkeypatch.setattr(filehash, "sha256_file", sha256)
    return read


def test_an_unchanged_folder_costs_a_stat_and_a_changed_file_is_hashed_again(tmp_path, monkeypatch):
    folder = tmp_path / "target"
    (folder / ".cache").mkdir(parents=True)
    (folder / ".cache" / "download.lock").write_text("bookkeeping")
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x00" * 4096)
    cache = tmp_path / "cache"
    read = counting(monkeypatch)
    first = HashCache(cache).tree(folder)
    assert sorted(read) == ["config.json", "model.safetensors"]  # hidden files are not content
    HashCache(cache).save()  # nothing learnt: nothing written
    hashes = HashCache(cache)
    assert hashes.tree(folder) == first  # not saved yet: hashed again
    hashes.save()
    read.clear()
    assert HashCache(cache).tree(folder) == first and read == []  # from the cache file
    # same-shape replacement weights: the size alone said nothing changed
    (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
    second = HashCache(cache).tree(folder)
    assert read == ["model.safetensors"]
    assert second["model.safetensors"] != first["model.safetensors"]
    assert second["config.json"] == first["config.json"]
    (cache / "sha256-cache.json").write_text(
        "{not json"
    )  # a damaged cache is hashed again, not trusted
    assert HashCache(cache).tree(folder) == second


def test_regeneration_never_resumes_work_of_other_weights(tmp_path):
    """Weights copied over the old ones keeping their size and date (`cp -p`) must not resume
    the batches the old ones regenerated: the resume folder's name changes."""
    from dflash.data.regenerate import _fingerprint

    target = tmp_path / "target"
    target.mkdir()
    weights = target / "model.safetensors"
    weights.write_bytes(b"\x00" * 4096)
    rows = tmp_path / "train.parquet"
    rows.write_bytes(b"rows")
    before = _fingerprint(rows, target, {}, 0, 1, HashCache(tmp_path))
    assert _fingerprint(rows, target, {}, 0, 1, HashCache(tmp_path)) == before
    old = weights.stat()
    weights.write_bytes(b"\x01" * 4096)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert _fingerprint(rows, target, {}, 0, 1, HashCache(tmp_path)) != before


@pytest.mark.slow
def test_new_weights_of_the_same_shape_rerun_what_reads_the_target(tmp_path):
    """A user's target entered the params by file sizes: replacement weights reran nothing. The
    compile warmup (off here: a recorded no-op) reads the target's config alone, so a config and
    stand-in weights are target enough."""
    folder = tmp_path / "my-target"
    folder.mkdir()
    shutil.copy(TESTS / "data" / "tiny-qwen3-config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"\x00" * 4096)
    config = yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())
    config["target"] = {"path": "my-target", "mask_token_id": 151669}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(TESTS / "data" / "local.jsonl", tmp_path)
    flow = Workflow(REPO, tmp_path)
    flow.run("warmup", config="user.yaml")
    assert flow.planned_jobs("warmup", config="user.yaml") == {}
    (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
    assert flow.planned_jobs("warmup", config="user.yaml") == {"warmup": 1, "warmup_compile": 1}


def test_a_hub_dataset_needs_a_pinned_commit_which_it_is_read_at(tmp_path, monkeypatch):
    import datasets

    source = {"name": "hub", "hf_dataset": "someone/chats"}
    with pytest.raises(ConfigError, match=r"data.sources.0: 'revision' is a dependency"):
        validate({"data": {"sources": [source]}})
    with pytest.raises(ConfigError, match=r"data.sources.0.revision: 'main' does not match"):
        validate({"data": {"sources": [source | {"revision": "main"}]}})
    asked = []

    def load_dataset(name, **kwargs):
        asked.append({"name": name, **kwargs})
        rows = [{"instruction": "q", "output": "a"}]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    commit = "0123456789abcdef0123456789abcdef01234567"
    data = validate({"data": {"sources": [source | {"revision": commit}]}})["data"]
    rows, report = collect(data, tmp_path)
    assert asked == [{"name": "someone/chats", "split": "train", "revision": commit}]
    assert len(rows) == 1 and report["hub"]["file"] == f"hf:someone/chats@{commit}"
