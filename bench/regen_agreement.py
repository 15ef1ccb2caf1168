"""How far two regenerations of the same rows agree (e.g. our engine's and vLLM's,
`data.regenerate.engine`): per assistant turn, whether the token ids are identical and how many
leading tokens they share. Greedy in both, so a difference starts at a near tie that the two
engines' arithmetic breaks differently, and everything after it is another text.

    python bench/regen_agreement.py results/data/regenerated/train.parquet other/train.parquet
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import polars as pl


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(a: pl.DataFrame, b: pl.DataFrame) -> dict:
    turns_b = dict(zip(b["id"].to_list(), b["turn_token_ids"].to_list(), strict=True))
    same, prefix, first_turns_same, compared = 0, [], 0, 0
    for row_id, turns in zip(a["id"].to_list(), a["turn_token_ids"].to_list(), strict=True):
        other = turns_b.get(row_id)
        if other is None:
            continue
        # later turns follow each engine's own earlier answers: compare while the texts agree
        for k, (x, y) in enumerate(zip(turns, other, strict=False)):
            compared += 1
            prefix.append(common_prefix(x, y) / max(len(x), len(y), 1))
            if x != y:
                break
            same += 1
            first_turns_same += k == 0
    return {
        "rows": a.height,
        "rows_in_both": sum(i in turns_b for i in a["id"].to_list()),
        "turns_compared": compared,
        "turns_identical": same,
        "first_turns_identical": first_turns_same,
        "mean_shared_prefix": round(statistics.fmean(prefix), 4) if prefix else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    print(json.dumps(agreement(pl.read_parquet(args.a), pl.read_parquet(args.b)), indent=1))


if __name__ == "__main__":
    main()
