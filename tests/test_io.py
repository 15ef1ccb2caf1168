import pytest

from dflash.io import atomic_path


def test_failed_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_directory_is_replaced_whole(tmp_path):
    target = tmp_path / "model"
    for version in ("v1", "v2"):
        with atomic_path(target, is_dir=True) as tmp:
            (tmp / "weights").write_text(version)
            if version == "v1":
                (tmp / "extra").write_text("only in v1")
    assert sorted(p.name for p in target.iterdir()) == ["weights"]
    assert (target / "weights").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
