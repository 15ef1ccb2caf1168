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


def test_a_second_answer_that_repeats_the_first_is_counted_as_lookups_long_copy():
    prompt, first, again = [1, 2, 3], list(range(100, 130)), [4, 5]
    ids = prompt + first + again + first  # the second answer repeats the first whole
    mask = [0] * 3 + [1] * 30 + [0] * 2 + [1] * 30
    frame = pl.DataFrame({"input_ids": [ids], "loss_mask": [mask]})
    got = copy_share.shares(frame, max_anchors=100, weights=(1.0, 4.0))
    # answer 0 repeats nothing
    assert got[0] == {"anchors": 29} | dict.fromkeys(
        ["copy", "run1", "run8", "run15", "drawn1", "drawn4"], 0.0
    )
    # answer 1: the 4-gram test needs three tokens of the repeat before the anchor (27 of 29);
    # lookup falls back to shorter n-grams and gets every anchor's next token right, 8 (15) of
    # them where 8 (15) tokens of the answer are left after the anchor
    assert got[1]["anchors"] == 29 and got[1]["run1"] == 1.0
    assert got[1]["copy"] == pytest.approx(27 / 29)
    assert got[1]["run8"] == pytest.approx(22 / 29)
    assert got[1]["run15"] == pytest.approx(15 / 29)
    # every anchor drawn (100 a row): the draws' share is the anchors' share, whatever the weight
    assert got[1]["drawn1"] == got[1]["drawn4"] == pytest.approx(27 / 29)
    # 10 draws of the row's 58 anchors, copy anchors 1000 times as likely: all copy anchors
    few = copy_share.shares(frame, max_anchors=10, weights=(1000.0,))
    assert few[1]["drawn1000"] == 1.0
