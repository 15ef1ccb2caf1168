"""Prompt-lookup drafting: most recent, longest match; never past the end of the sequence."""

import random

import torch

from dflash.eval.lookup import prompt_lookup_draft


def test_match_returns_following_tokens_truncated_to_k():
    ids = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]
    assert prompt_lookup_draft(ids, k=3) == [4, 5, 6]
    assert prompt_lookup_draft(ids, k=10) == [4, 5, 6, 7, 9, 1, 2, 3]
    assert prompt_lookup_draft(ids, k=0) == []


def test_tensor_input():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3])
    assert prompt_lookup_draft(ids, k=2) == [4, 5]


def test_most_recent_match_preferred():
    ids = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert prompt_lookup_draft(ids, k=2, max_ngram=2) == [20, 21]


def test_longer_ngram_preferred_over_more_recent_shorter():
    # "2 3" recurs earlier (-> 7); only "3" recurs more recently (-> 8).
    ids = [2, 3, 7, 5, 3, 8, 2, 3]
    assert prompt_lookup_draft(ids, k=1) == [7]
    assert prompt_lookup_draft(ids, k=1, max_ngram=1) == [8]
    assert prompt_lookup_draft(ids, k=1, min_ngram=2) == [7]


def test_no_match():
    assert prompt_lookup_draft([1, 2, 3, 4], k=4) == []
    assert prompt_lookup_draft([], k=4) == []
    assert prompt_lookup_draft([5], k=4) == []
    assert prompt_lookup_draft([1, 2, 1, 3], k=2, min_ngram=2) == []


def test_never_past_the_end():
    # The suffix itself has no continuation and is not a match; the overlapping occurrence one
    # step back has exactly one token after it.
    assert prompt_lookup_draft([7, 7, 7], k=4, max_ngram=2) == [7]
    assert prompt_lookup_draft([1, 2, 3, 4, 3, 4], k=5, max_ngram=2) == [3, 4]
    # The only occurrence of [9] is the suffix: no continuation, so no draft.
    assert prompt_lookup_draft([1, 2, 9], k=3) == []


def _scan(ids, k, max_ngram=3, min_ngram=1):
    """The rule spelt out as a loop: the longest n first, then its most recent occurrence."""
    for n in range(max_ngram, max(min_ngram, 1) - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == ids[len(ids) - n :]:
                return ids[start + n : start + n + k]
    return []


def test_agrees_with_the_rule_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randrange(40))]
        k, top = rng.randrange(6), rng.randrange(1, 5)
        low = rng.randrange(top + 1)
        assert prompt_lookup_draft(ids, k, top, low) == _scan(ids, k, top, low)
