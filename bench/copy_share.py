"""How much of a tokenized split copies its own context, answer by answer, over the training
anchors (positions a where a and a+1 are trainable):

- copy anchors: the 4-gram a-2..a+1 occurred earlier in the row (`copies_context`, what
  `drafter.copy_anchor_weight` weighs);
- prompt lookup's accepted run there: the evaluation's own `prompt_lookup_draft` of 15 tokens
  from the row up to a, accepted as far as it equals the answer's next tokens (one round,
  teacher-forced; the answer's end caps it): the share of anchors with 1+, 8+ and 15 accepted;
- the share of copy anchors among those training draws, drawn by `sample_anchors` itself with
  `max_anchors` per row and each --weights (1: the uniform draw);
- with --target and --drafter: the drafter's own accepted tokens at every anchor (teacher-forced,
  `block_matches`, fp32 on the CPU or the GPU) beside lookup's, by how far lookup gets: does the
  drafter copy where lookup does?

    python bench/copy_share.py results/data/tokenized/train.parquet [--max-anchors 96] \
        [--target resources/target/<name>/hf --drafter results/drafter [--rows 64]]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.eval.lookup import prompt_lookup_draft  # noqa: E402
from dflash.model.objective import copies_context, sample_anchors  # noqa: E402
from dflash.model.tau_sim import response_spans  # noqa: E402

DRAFT = 15  # a block of 16: the anchor and 15 drafted tokens
RUNS = (1, 8, DRAFT)


def lookup_run(ids: list[int], a: int, last: int) -> int:
    """Tokens after anchor a that prompt lookup, drafting from ids[:a+1], gets right up to the
    answer's last token at `last`."""
    draft = prompt_lookup_draft(ids[: a + 1], min(DRAFT, last - a))
    run = 0
    while run < len(draft) and draft[run] == ids[a + 1 + run]:
        run += 1
    return run


def answer_of(spans: list[tuple[int, int]], n: int) -> list[int | None]:
    """Per position, the index of the answer it anchors in (a and a+1 in it), else None; spans
    as `response_spans` gives them, (first, last)."""
    index: list[int | None] = [None] * n
    for k, (first, last) in enumerate(spans):
        index[first:last] = [k] * (last - first)
    return index


def shares(frame: pl.DataFrame, max_anchors: int, weights=(1.0,), seed: int = 0) -> dict:
    """answer index (0, 1, "2+") -> anchors, copy share, lookup run shares, and per weight w the
    share of copy anchors among the drawn ones."""
    counts = defaultdict(lambda: defaultdict(float))
    generator = torch.Generator().manual_seed(seed)
    for ids, mask in zip(frame["input_ids"].to_list(), frame["loss_mask"].to_list(), strict=True):
        row, loss_mask = torch.tensor([ids]), torch.tensor([mask])
        copies = copies_context(row)[0].tolist()
        spans = response_spans(mask)
        index = answer_of(spans, len(ids))
        for a, k in enumerate(index):
            if k is None:
                continue
            c = counts[min(k, 2)]
            c["anchors"] += 1
            c["copy"] += copies[a]
            run = lookup_run(ids, a, spans[k][1])
            for n in RUNS:
                c[f"run{n}"] += run >= n
        for w in weights:
            anchors, valid = sample_anchors(loss_mask, max_anchors, generator, row, w)
            for a in anchors[valid].tolist():
                c = counts[min(index[a], 2)]
                c[f"drawn{w:g}"] += 1
                c[f"copies{w:g}"] += copies[a]
    table = {}
    for k, c in sorted(counts.items()):
        n = c["anchors"]
        row = {"anchors": int(n), "copy": c["copy"] / n}
        row |= {f"run{r}": c[f"run{r}"] / n for r in RUNS}
        row |= {f"drawn{w:g}": c[f"copies{w:g}"] / max(c[f"drawn{w:g}"], 1) for w in weights}
        table["2+" if k == 2 else k] = row
    return table


def lookup_bucket(run: int) -> str:
    return "0" if run == 0 else "1-7" if run < 8 else "8-14" if run < DRAFT else "15"


@torch.no_grad()
def drafter_against_lookup(frame: pl.DataFrame, target: Path, drafter: Path) -> dict:
    """("first" | "later" answers, lookup bucket) -> (anchors, drafter's mean accepted, lookup's
    mean accepted), the drafter's teacher-forced on the target's features of each row."""
    from dflash.eval.predicted import full_features
    from dflash.eval.setup import load_models
    from dflash.model.tau_sim import block_matches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, draft, _ = load_models({"eval": {"device": device, "dtype": "float32"}}, target, drafter)
    embed, head = model.get_input_embeddings(), model.lm_head.weight
    found = defaultdict(list)
    for ids, mask in zip(frame["input_ids"].to_list(), frame["loss_mask"].to_list(), strict=True):
        features = full_features(model, ids, draft.config.target_layer_ids)
        row = torch.tensor(ids)
        for k, (first, last) in enumerate(response_spans(mask)):
            anchors = torch.arange(first, last)  # as tau_sim's walk anchors them
            matched = block_matches(draft, embed, head, features, row, anchors, last).tolist()
            for a, d in zip(anchors.tolist(), matched, strict=True):
                run = lookup_run(ids, a, last)
                found[("first" if k == 0 else "later", lookup_bucket(run))].append((d, run))
    order = [(t, b) for t in ("first", "later") for b in ("0", "1-7", "8-14", "15")]
    return {
        key: (len(v), sum(d for d, _ in v) / len(v), sum(r for _, r in v) / len(v))
        for key in order
        if (v := found.get(key))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenized", type=Path)
    parser.add_argument("--max-anchors", type=int, default=96, help="drafter.max_anchors")
    parser.add_argument("--weights", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    parser.add_argument("--target", type=Path, help="the target's hf/ folder")
    parser.add_argument("--drafter", type=Path, help="an exported drafter (results/drafter)")
    parser.add_argument("--rows", type=int, help="only the first ROWS rows")
    args = parser.parse_args()
    frame = pl.read_parquet(args.tokenized)
    frame = frame.head(args.rows) if args.rows else frame
    table = shares(frame, args.max_anchors, args.weights)
    drawn = [f"w {w:g}" for w in args.weights]
    print(
        "| answer | anchors | copy anchors | lookup accepts 1+ | 8+ | 15 | "
        f"copy anchors drawn, {' | '.join(drawn)} |"
    )
    print("|---|---|---|---|---|---|" + "---|" * len(drawn))
    for k, s in table.items():
        cells = [f"{s[f'run{n}']:.3f}" for n in RUNS]
        cells += [f"{s[f'drawn{w:g}']:.3f}" for w in args.weights]
        print(f"| {k} | {s['anchors']} | {s['copy']:.3f} | {' | '.join(cells)} |")
    if args.target and args.drafter:
        print("\n| answers | lookup accepts | anchors | drafter accepts (mean) | lookup (mean) |")
        print("|---|---|---|---|---|")
        for (turn, bucket), (n, d, r) in drafter_against_lookup(
            frame, args.target, args.drafter
        ).items():
            print(f"| {turn} | {bucket} | {n} | {d:.2f} | {r:.2f} |")


if __name__ == "__main__":
    main()
