"""Prompt-lookup (n-gram) drafting: the model-free baseline every trained drafter must beat.

Prompt lookup decoding (transformers' `prompt_lookup_num_tokens`) drafts by copying: it finds an
earlier occurrence of the last few tokens and proposes what followed them. It costs no model and
does well wherever the reply repeats the prompt (code edits, summaries, extraction), so a trained
drafter whose acceptance does not beat it on a set is a finding, not a detail.
"""

from __future__ import annotations


def prompt_lookup_draft(ids, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens.

    `ids` (a list or a 1-D tensor) is the prompt plus the tokens generated so far. n runs from
    `max_ngram` down to `min_ngram`, so a longer match wins over a more recent shorter one.
    Returns [] when no n-gram recurs (the suffix itself, which has nothing after it, never counts).
    """
    if getattr(ids, "ndim", 1) != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    seq = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if k <= 0:
        return []
    for n in range(max_ngram, max(min_ngram, 1) - 1, -1):
        tail = seq[-n:]
        # Starts from len - n - 1 down: every candidate has at least one token after it.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []
