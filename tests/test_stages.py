"""The stage registry (dflash/stages) is the one declaration of a stage: the rules call exactly the
arguments it declares, every key it names is a config key, and no stage writes its manifest
itself (the CLI writes every one from the declaration)."""

import importlib
import re
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from dflash.stages import INERT, STAGES, by_rule
from dflash.stages.spec import IN, OUT, subset

REPO = Path(__file__).resolve().parents[1]


def rule_shells() -> dict[str, str]:
    """Rule -> its shell command's text, from the rule files as snakefmt writes them."""
    shells = {}
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", path.read_text(), flags=re.M)[1:]:
            name = block.split(":", 1)[0]
            shell = block.split("    shell:", 1)[1] if "    shell:" in block else ""
            shells[name] = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', shell.split("\n\n")[0]))
    return shells


def test_every_rule_calls_its_stage_with_the_arguments_the_stage_declares():
    shells = rule_shells()
    called = {
        rule: m.group(1) for rule, s in shells.items() if (m := re.search(r"-m dflash (\S+)", s))
    }
    assert called, shells
    for rule, command in called.items():
        stage = STAGES[command]
        assert rule in stage.rules, f"rule {rule} runs `{command}`, whose entry names {stage.rules}"
        flags = set(re.findall(r"(--[a-z-]+)", shells[rule].split(f"-m dflash {command}", 1)[1]))
        declared = {a.flag for a in stage.args} | {"--config", "--manifest"}
        assert flags <= declared, (rule, flags - declared)
        required = {a.flag for a in stage.args if a.required and a.flag.startswith("--")}
        assert required <= flags, (rule, required - flags)
        assert ("--manifest" in flags) == stage.manifest, rule
        assert ("--config" in flags) == bool(stage.config), rule
    assert {r for s in STAGES.values() for r in s.rules} == set(called)


def test_every_stage_function_exists_and_every_key_it_names_is_a_config_key():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())

    def exists(key: str) -> bool:
        node = schema
        for part in key.split("."):
            node = node.get("properties", {}).get(part)
            if node is None:
                return False
        return True

    for stage in STAGES.values():
        module, function = stage.run.split(":")
        assert callable(getattr(importlib.import_module(module), function)), stage.run
        for key in (*stage.config, *stage.inert):
            assert key == "" or exists(key), f"{stage.command}: {key} is no config key"
    assert all(exists(key) for key in INERT)


def test_the_triggers_are_the_keys_read_but_the_inert_ones():
    config = {
        "seed": 0,
        "cache_dir": "~/.cache/dflash",
        "drafter": {"gamma": None, "init": "random"},
        "eval": {"max_prompts": 8, "ddtree": {"budgets": [4, 16]}, "baselines": ["lookup"]},
        "train": {"lr": 1e-3, "tensorboard": True},
    }
    acceptance = STAGES["eval"].depends(config)
    assert acceptance == {
        "seed": 0, "drafter.gamma": None, "eval.max_prompts": 8, "eval.baselines": ["lookup"]
    }  # fmt: skip
    tree = STAGES["ddtree"].depends(config)
    assert tree == {"seed": 0, "eval.max_prompts": 8, "eval.ddtree.budgets": [4, 16]}
    # the stage is still given every key it reads, inert ones among them
    assert STAGES["eval"].passed(config)["eval"]["ddtree"] == {"budgets": [4, 16]}
    assert by_rule("train").depends(config) == {"seed": 0, "drafter.gamma": None, "train.lr": 1e-3}
    assert subset(config, ["train.lr", "missing.key"]) == {"train": {"lr": 1e-3}}


def test_the_manifest_records_the_declared_paths_the_triggers_and_what_the_stage_adds():
    stage = STAGES["tokenize"]
    args = Namespace(
        config={"data": {"max_length": 96, "num_proc": 2}},
        target=Path("t"),
        input=Path("in.parquet"),
        output=Path("out.parquet"),
    )
    assert {a.dest for a in stage.args if a.role in (IN, OUT)} == {"target", "input", "output"}
    made = {"outputs": {"report": Path("out.report.json")}}
    inputs, outputs, params = stage.recorded(args, made)
    assert inputs == {"target": Path("t"), "input": Path("in.parquet")}
    assert outputs == {"output": Path("out.parquet"), "report": Path("out.report.json")}
    assert params == {"data": {"max_length": 96}}  # num_proc changes no byte


@pytest.mark.parametrize("folder", ["data", "eval", "model", "train"])
def test_no_stage_writes_its_manifest_itself(folder):
    """The manifest is written in one place (dflash/cli.py, from the registry)."""
    for path in sorted((REPO / "dflash" / folder).glob("*.py")):
        assert "write_manifest(" not in path.read_text(), path
