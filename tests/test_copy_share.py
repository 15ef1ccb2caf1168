"""bench/copy_share.py: the share of training anchors where the answer copies its context."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pytest

PATH = Path(__file__).resolve().parents[1] / "bench/copy_share.py"
spec = importlib.util.spec_from_file_location("copy_share", PATH)
copy_share = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy_share)


def test_a_second_answer_that_repeats_the_first_is_counted_as_a_long_copy():
    prompt, first, again = [1, 2, 3], list(range(100, 130)), [4, 5]
    ids = prompt + first + again + first  # the second answer repeats the first whole
    mask = [0] * 3 + [1] * 30 + [0] * 2 + [1] * 30
    got = copy_share.shares(pl.DataFrame({"input_ids": [ids], "loss_mask": [mask]}))
    # answer 0 repeats nothing; in answer 1 every anchor from its third token on (lookup matches
    # three committed tokens) copies the first answer, and the copy runs on for 8 (15) tokens
    # where 8 (15) tokens of the row are left after the anchor
    assert got[0] == {"anchors": 29, "copy": 0.0, "run1": 0.0, "run8": 0.0, "run15": 0.0}
    assert got[1]["anchors"] == 29
    assert got[1]["copy"] == got[1]["run1"] == pytest.approx(27 / 29)
    assert got[1]["run8"] == pytest.approx(20 / 29)
    assert got[1]["run15"] == pytest.approx(13 / 29)
