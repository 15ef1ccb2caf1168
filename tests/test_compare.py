"""`dflash compare` on small hand-made records: what counts as a cause, and how much."""

from dflash.compare import compare, render


def record(**parts) -> dict:
    base = {
        "_name": "run",
        "code": {"files": {"dflash/train/loop.py": "a", "dflash/compare.py": "a"}},
        "stages": {"train": {"code_files": ["dflash/train/loop.py"]}},
        "environment": {"torch": "2.13.0", "packages": {"torch": "2.13.0"}},
        "config": {"compile": {"enabled": True}, "train": {"lr": 1e-3}},
        "topology": {"targets": 1, "drafters": 1},
        "train": {"throughput": {"tokens_per_s": 1000.0}},
    }
    return base | parts


def test_an_edit_no_stage_ran_ranks_below_a_training_config_change():
    b = record(
        code={"files": {"dflash/train/loop.py": "a", "dflash/compare.py": "b"}},
        config={"compile": {"enabled": False}, "train": {"lr": 1e-3}},
        train={"throughput": {"tokens_per_s": 600.0}},
    )
    result = compare(record(), b)
    assert [c["kind"] for c in result["causes"]] == ["config", "code"]
    assert "compile.enabled: True → False" in render(result)  # not "1 → 0 (-100 %)"


def test_what_one_side_did_not_record_is_not_a_cause():
    older = record()
    del older["environment"], older["topology"]  # a results folder from an older version
    assert compare(older, record())["causes"] == []
