"""The shipped config files validate against the schema, and the example for one's own model
writes out every key a user would set."""

from pathlib import Path

import pytest
import yaml

from dflash.config import ConfigError, flatten, load_config, load_schema

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "config").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    load_config(path)


def test_the_own_model_example_writes_out_every_key_a_user_sets():
    """Keys left out take GPU-scale defaults without a word: the example names them all. Only
    keys that name machinery rather than a choice (devices, the compile cache and attention, the
    stats of an earlier run are written, so none of those) may be left to the schema."""
    written = flatten(yaml.safe_load((REPO / "config" / "my-model.yaml").read_text()))
    filled = flatten(load_config(REPO / "config" / "my-model.yaml"))
    left_to_the_schema = {
        key
        for key in filled.keys() - written.keys()
        if not key.startswith(("data.sources", "eval.sets"))
    }
    assert left_to_the_schema <= {
        "target.hub_id",
        "target.revision",
        "target.gguf_wheel",
        "target.random_init",
        "data.regenerate.device",
        "compile.cache_dir",
        "compile.device",
        "compile.attention",
        "train.weight_decay",
        "train.device",
        "train.timeout_s",
        "train.startup_timeout_s",
        "eval.device",
    }, sorted(left_to_the_schema)
    assert written["target.path"] and written["data.sources"][0]["path"]


def test_the_schema_says_which_defaults_assume_a_gpu():
    """The defaults sized for a GPU run say so in their descriptions."""
    props = load_schema()["properties"]

    def described(*keys):
        node = props
        for key in keys[:-1]:
            node = node[key]["properties"]
        return node[keys[-1]].get("description", "")

    for keys in [
        ("compile", "enabled"),
        ("drafter", "num_layers"),
        ("drafter", "max_anchors"),
        ("data", "regenerate", "max_new_tokens"),
        ("eval", "baselines"),
        ("eval", "ddtree", "budgets"),
    ]:
        assert "GPU" in described(*keys), keys


def test_trust_remote_code_is_refused_naming_the_key(tmp_path):
    """No model code from a target's folder is ever run, so the key that once promised it (and
    was never read) is refused rather than silently ignored."""
    config = tmp_path / "remote.yaml"
    config.write_text(yaml.safe_dump({"target": {"path": "t", "trust_remote_code": True}}))
    with pytest.raises(ConfigError, match=r"target: .*'trust_remote_code' was unexpected"):
        load_config(config)


@pytest.mark.parametrize("init", ["random", "target_top", "drafters/run-1", "/abs/drafter"])
def test_drafter_init_takes_random_target_top_or_an_exported_drafters_path(init):
    from dflash.config import validate

    assert validate({"drafter": {"init": init}})["drafter"]["init"] == init
    assert validate({})["drafter"]["init"] == "random"


@pytest.mark.parametrize("init", ["", 3, None])
def test_drafter_init_refuses_what_is_no_name_and_no_path(init):
    from dflash.config import validate

    with pytest.raises(ConfigError, match=r"drafter\.init: "):
        validate({"drafter": {"init": init}})
