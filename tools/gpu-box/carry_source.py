"""Keep one source's rows of a tokenized split (tools/gpu-box/carrydata.sh with $SOURCE): the source of a
row comes from the expand stage's split, joined by row id.

    python3 tools/gpu-box/carry_source.py ROWS REPORT EXPANDED SOURCE OUT
"""

import json
import sys
from pathlib import Path

import polars as pl


def main(rows: str, report: str, expanded: str, source: str, out: str) -> None:
    ids = pl.read_parquet(expanded).filter(pl.col("source") == source).select("id")
    kept = pl.read_parquet(rows).join(ids, on="id", how="semi")
    if kept.is_empty():
        sys.exit(f"{expanded}: no row of source {source!r} among the ids of {rows}")
    kept.write_parquet(out)
    # the tokenize stage's counts are the whole split's
    meta = {
        "rows_out": kept.height,
        "source_only": source,
        "whole_split": json.loads(Path(report).read_text()),
    }
    Path(out).with_suffix(".report.json").write_text(json.dumps(meta, indent=2))
    print(f"{source}: {kept.height} rows, {kept['trainable'].sum()} trainable tokens")


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    main(*sys.argv[1:])
