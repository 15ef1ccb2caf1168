"""Every config mistake is one line naming where it is: the file and line (or --config), the
key, the nearest valid key for a misspelt one; a YAML syntax error names the file, line and
column. A typo'd key printed 218-229 lines of schema, a YAML error neither file nor line."""

from __future__ import annotations

import shutil

import pytest
import yaml
from conftest import REPO, TESTS, Workflow

from dflash.config import ConfigError, load_config, validate
from dflash.config_errors import describe
from dflash.yaml_lines import syntax_error

TINY = (TESTS / "data" / "tiny.yaml").read_text()


def test_a_misspelt_key_names_its_file_line_and_the_nearest_key(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(TINY.replace("  train_rows: 6", "  trian_rows: 6"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    line = TINY.splitlines().index("  train_rows: 6") + 1
    assert str(e.value) == (
        f"{path}, line {line}: data.trian_rows: unknown key; did you mean data.train_rows?"
    )
    with pytest.raises(ConfigError, match=r"^--config: seedd: unknown key; did you mean seed\?$"):
        validate({"seedd": 1}, cli={"seedd": 1})
    with pytest.raises(ConfigError, match=r"zzz: unknown key; the keys here are block_size, "):
        validate({"drafter": {"zzz": 1}})


def test_wrong_values_are_one_line_each(tmp_path):
    path = tmp_path / "my.yaml"
    config = yaml.safe_load(TINY)
    config["train"]["lr"] = -1
    config["data"]["token_budget"] = "lots"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("data.token_budget: 'lots' is not an integer >= 1 or 'auto'")
    assert lines[1].endswith("train.lr: -1 is less than or equal to the minimum of 0")
    assert all(line.startswith(f"{path}, line ") for line in lines)
    assert describe({"enum": [True, "true"]}) == "one of True, 'true'"


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 0\ndata:\n  train_rows: [1, 2\n  eval_rows: 3\n")
    assert syntax_error(path) == (
        f"config file {path}, line 4, column 12: YAML syntax error: expected ',' or ']',"
        " but got ':'"
    )
    assert syntax_error(TESTS / "data" / "tiny.yaml") is None


@pytest.mark.parametrize(
    "edit, said",
    [
        (
            lambda text: text.replace("  train_rows: 6", "  trian_rows: 6"),
            "bad.yaml, line 24: data.trian_rows: unknown key; did you mean data.train_rows?",
        ),
        (
            lambda text: text.replace("  eval_rows: 2", "  eval_rows: [2"),
            "config file bad.yaml, line 26, column 13: YAML syntax error: expected ',' or ']'",
        ),
    ],
    ids=["typo", "yaml"],
)
def test_snakemake_says_the_mistake_in_a_few_lines(tmp_path, edit, said):
    """Through Snakemake itself: the YAML error by the loader every Python of the environment
    wraps (scripts/setup.sh's .pth file), the typo by the pre-job checks."""
    assert TINY.splitlines()[23:25] == ["  train_rows: 6", "  eval_rows: 2"]
    (tmp_path / "bad.yaml").write_text(edit(TINY))
    shutil.copy(TESTS / "data" / "local.jsonl", tmp_path)
    done = Workflow(REPO, tmp_path).run("-n", "all", config="bad.yaml", check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and said in out, out[-2000:]
    stream = next(x for x in (done.stderr, done.stdout) if "WorkflowError" in x)
    error = stream[stream.index("WorkflowError") :].strip().splitlines()
    assert len(error) <= 3, error  # the error, its line, where in the Snakefile
