"""Which source files a stage's code hash covers: exactly what it runs."""

import pytest

from dflash.manifest import code_hash, imported_files


def names(module):
    return {
        f.relative_to(f.parents[1]).as_posix() if f.parent.name != "dflash" else f.name
        for f in imported_files(module)
    }


def test_a_stage_covers_what_it_imports_transitively_and_nothing_else():
    train = names("dflash.train.loop")
    assert {"model/drafter.py", "data/batching.py", "train/comm.py", "manifest.py"} <= train
    assert not any(n.startswith("eval/") for n in train)
    assert "data/expand.py" not in train and "cli.py" not in train
    report = names("dflash.eval.report")
    assert "eval/report.py" in report and "eval/run.py" not in report
    # a function-level import counts: decode imports ddtree inside a function
    assert "eval/ddtree.py" in names("dflash.eval.run")


def test_code_hash_refuses_what_is_not_a_module():
    with pytest.raises(ValueError, match="not dflash modules"):
        code_hash("data")
