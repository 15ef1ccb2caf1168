"""Huge messages cut by characters before they are tokenized, so memory stays bounded.

A conversation is cut to `max_tokens` tokens after tokenizing anyway; tokenizing ten 10 MB
messages first took 3.1 GB and 16 s a row. No token is anywhere near CHARS_PER_TOKEN characters
long on average (English runs ~4), so a message cut to `max_tokens * CHARS_PER_TOKEN`
characters still gives more than `max_tokens` tokens and MARGIN more, and the tokens kept lie
well before the cut: those of the whole message. Where it does not (a long run of one character,
say), the bound grows and the conversation is tokenized again. Applied whatever `max_chars` says
(that one drops conversations; this changes none), for templates that render a message's text
in place (one that rewrites it, e.g. strips an earlier turn's reasoning, may differ at the cut).
"""

from __future__ import annotations

from collections.abc import Callable

CHARS_PER_TOKEN = 32
# tokens past the limit that a cut must still leave: the template's end of turn after the cut
# and a word cut in two stay that far from the tokens kept
MARGIN = 64


def cut_turns(turns: list[dict], limit: int) -> tuple[list[dict], bool]:
    """The turns with each content cut to `limit` characters, and whether any was."""
    if all(len(t["content"]) <= limit for t in turns):
        return turns, False
    return [t | {"content": t["content"][:limit]} for t in turns], True


def encode_bounded(encode: Callable[[list[dict]], tuple], turns: list[dict], max_tokens: int):
    """`encode(turns)` -> (result, token count) on turns cut to a character bound, and whether
    they were cut; a cut is kept only when the token count still exceeds `max_tokens` + MARGIN."""
    limit = max_tokens * CHARS_PER_TOKEN
    while True:
        short, cut = cut_turns(turns, limit)
        result, tokens = encode(short)
        if not cut or tokens > max_tokens + MARGIN:
            return result, cut
        limit *= 4
