"""Acceptance metric definitions on hand-made acceptance sequences."""

from dflash.eval.metrics import acceptance


def test_tau_macro_and_pooled_differ_as_defined():
    # prompt A: 2 rounds of 4 -> mean 4; prompt B: 4 rounds of 1 -> mean 1
    m = acceptance([[4, 4], [1, 1, 1, 1]], block_size=4)
    assert m["tau_macro"] == 2.5  # (4 + 1) / 2
    assert m["tau_pooled"] == 2.0  # 12 tokens / 6 forwards
    assert m["rounds"] == 6 and m["n_prompts"] == 2


def test_histogram_and_conditional_rates():
    m = acceptance([[1, 2, 2, 3, 4, 4, 4, 4]], block_size=4)
    assert m["histogram"] == {1: 1, 2: 2, 3: 1, 4: 4}
    # P(>=2 | >=1) = 7/8, P(>=3 | >=2) = 5/7, P(>=4 | >=3) = 4/5
    assert m["rates"] == {2: round(7 / 8, 4), 3: round(5 / 7, 4), 4: 0.8}


def test_rates_after_nothing_accepted_are_undefined_not_zero():
    m = acceptance([[1, 1], [2]], block_size=4)
    assert m["rates"][2] == round(1 / 3, 4) and m["rates"][3] == 0.0 and m["rates"][4] is None


def test_empty():
    assert acceptance([[]], block_size=4) == {"n_prompts": 1, "rounds": 0}
