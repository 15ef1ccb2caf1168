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
        "overwrite_results",  # one command's override (dflash/run_owner.py), not a choice
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
    with pytest.raises(
        ConfigError, match=r"remote.yaml, line 3: target.trust_remote_code: unknown key"
    ):
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


def test_a_held_out_source_not_listed_or_holding_out_nothing_is_refused_naming_the_key():
    from dflash.config import check_sources

    sources = [{"name": "sharegpt"}, {"name": "codeio"}]
    config = {
        "data": {"sources": sources, "eval_rows": {"sharegpt": 24, "codeio": 0, "nope": 1}},
        "eval": {"sets": [{"format": "held_out", "source": "codeio"}, {"source": "typo"}]},
    }
    with pytest.raises(ConfigError) as e:
        check_sources(config, "c.yaml")
    assert str(e.value) == (
        "c.yaml: data.eval_rows.nope: no source named 'nope'; eval.sets[0].source: "
        "data.eval_rows holds out no row of 'codeio'; eval.sets[1].source: no source named "
        "'typo' (data.sources: ['sharegpt', 'codeio'])"
    )
    config["data"]["eval_rows"] = {"sharegpt": 24, "codeio": 16}
    config["eval"]["sets"].pop()
    assert check_sources(config) is config
