"""How much of a tokenized split copies its own context, answer by answer: the share of training
anchors (positions a where a and a+1 are trainable) whose next token prompt lookup could have
proposed (the 4-gram a-2..a+1 seen earlier in the row: `copies_context`, what
`drafter.copy_anchor_weight` weighs), and where lookup's match runs on for 8 and for 15 tokens
(a whole block of 16 accepted by copying).

    python bench/copy_share.py results/data/tokenized/train.parquet [--weights 2 4]

With copy anchor weight w, a copy position is drawn w times as likely: a share p of copy
positions becomes w p / (w p + 1 - p) of the draws, printed for each --weights.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.model.objective import COPY_NGRAM, copies_context  # noqa: E402

RUNS = (1, 8, 15)  # lookup's match continuing for at least this many tokens
MATCH = COPY_NGRAM - 1  # lookup matches the last three committed tokens


def answers(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trainable tokens: one answer each."""
    spans, start = [], None
    for i, v in enumerate([*loss_mask, 0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


def copy_run(ids: list[int], earlier: dict, a: int, cap: int) -> int:
    """How many tokens from a+1 on repeat what followed an earlier occurrence of a-2..a."""
    best = 0
    for j in earlier.get(tuple(ids[a - MATCH + 1 : a + 1]), ()):
        t = 0
        while a + 1 + t < len(ids) and ids[j + 1 + t] == ids[a + 1 + t] and t < cap:
            t += 1
        best = max(best, t)
        if best >= cap:
            break
    return best


def shares(frame: pl.DataFrame) -> dict:
    """answer index (0, 1, "2+") -> anchors, copy share, and the share of each lookup run."""
    counts = defaultdict(lambda: defaultdict(int))
    for ids, mask in zip(frame["input_ids"].to_list(), frame["loss_mask"].to_list(), strict=True):
        copies = copies_context(torch.tensor([ids]))[0].tolist()
        earlier = defaultdict(list)  # last MATCH tokens -> positions of their last token so far
        spans = answers(mask)
        for a in range(len(ids) - 1):
            k = next((i for i, (s, e) in enumerate(spans) if s <= a < e - 1), None)
            if k is not None and a >= MATCH - 1:
                c = counts[min(k, 2)]
                c["anchors"] += 1
                c["copy"] += copies[a]
                run = copy_run(ids, earlier, a, max(RUNS))
                for n in RUNS:
                    c[f"run{n}"] += run >= n
            if a >= MATCH - 1:
                earlier[tuple(ids[a - MATCH + 1 : a + 1])].append(a)
    return {
        ("2+" if k == 2 else k): {"anchors": c["anchors"]}
        | {key: c[key] / c["anchors"] for key in ("copy", *(f"run{n}" for n in RUNS))}
        for k, c in sorted(counts.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenized", type=Path)
    parser.add_argument("--weights", type=float, nargs="*", default=[2.0, 4.0])
    args = parser.parse_args()
    table = shares(pl.read_parquet(args.tokenized))
    print("| answer | anchors | copy (4-gram) | lookup runs 1+ | 8+ | 15+ |")
    print("|---|---|---|---|---|---|")
    for k, s in table.items():
        runs = " | ".join(f"{s[f'run{n}']:.3f}" for n in RUNS)
        print(f"| {k} | {s['anchors']} | {s['copy']:.3f} | {runs} |")
    total = sum(s["anchors"] for s in table.values())
    p = sum(s["copy"] * s["anchors"] for s in table.values()) / total
    drawn = ", ".join(f"w {w:g}: {w * p / (w * p + 1 - p):.3f}" for w in args.weights)
    print(f"\ncopy share of all {total} anchors {p:.3f}; of the draws with {drawn}")


if __name__ == "__main__":
    main()
