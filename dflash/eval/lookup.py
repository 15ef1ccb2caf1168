"""Prompt-lookup (n-gram) drafting: the model-free baseline every trained drafter must beat.

Prompt lookup decoding (transformers' `prompt_lookup_num_tokens`) drafts by copying: it finds an
earlier occurrence of the last few tokens and proposes what followed them. It costs no model and
does well wherever the reply repeats the prompt (code edits, summaries, extraction), so a trained
drafter whose acceptance does not beat it on a set is a finding, not a detail.
"""

from __future__ import annotations

import numpy as np


def prompt_lookup_draft(ids, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens.

    `ids` (a list or a 1-D tensor) is the prompt plus the tokens generated so far. n runs from
    `max_ngram` down to `min_ngram`, so a longer match wins over a more recent shorter one.
    Returns [] when no n-gram recurs (the suffix itself, which has nothing after it, never counts).

    The scan is vectorised: it runs every decoding round inside the evaluation's clock, and a
    Python loop over a 2,000-token context took 1.2 ms a round (a 2-core AMD EPYC; the target's
    whole forward at batch 1 on an H200 takes 1.75 ms), numpy 0.06 ms.
    """
    if getattr(ids, "ndim", 1) != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    seq = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=np.int64)
    if k <= 0:
        return []
    length = len(seq)
    for n in range(max_ngram, max(min_ngram, 1) - 1, -1):
        starts = length - n  # candidate starts 0 .. length-n-1: each has a token after it
        if starts <= 0:
            continue
        match = seq[:starts] == seq[length - n]
        for j in range(1, n):
            match &= seq[j : starts + j] == seq[length - n + j]
        found = np.flatnonzero(match)
        if found.size:
            start = int(found[-1]) + n
            return seq[start : start + k].tolist()
    return []
