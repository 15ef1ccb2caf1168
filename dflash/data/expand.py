"""expand_dataset: merge sources, normalise, filter, dedupe, shuffle, split.

Every row that does not reach the output is counted under a reason in the report; with
`on_bad_row: error` a malformed row stops the stage with a message naming its file and row.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

import polars as pl

from dflash.config import check_sources, expand_user
from dflash.data import domains
from dflash.data.normalize import BadRow, chars, clean, conversation_id, from_template, to_turns
from dflash.data.sources import DataError, SourceInfo, read_source
from dflash.data.textmatch import normalized, probe, searchable, user_turns
from dflash.io import atomic_path, write_json

# Rows malformed as input (as opposed to well-formed rows we choose to filter out).
MALFORMED = {
    "malformed_json",
    "not_an_object",
    "not_utf8",
    "wrong_shape",
    "missing_key",
    "unknown_role",
    "unknown_shape",
}
EXAMPLES_PER_REASON = 5
log = logging.getLogger(__name__)

# `extra`: JSON of a turn's tool calls or tool-result keys (dflash.data.tools), null otherwise
TURN = pl.Struct({"role": pl.String, "content": pl.String, "extra": pl.String})
CONVERSATION = pl.List(TURN)


def _row_problem(row, max_turns, template=None):
    """(turns, repairs, None) for a usable row, (None, [], BadRow) otherwise."""
    if row.record is None:
        return None, [], BadRow(row.problem, row.detail)
    try:
        record = from_template(row.record, template) if template else row.record
        return *clean(to_turns(record), max_turns), None
    except BadRow as bad:
        return None, [], bad


def _note(counts: Counter, examples: dict, reason: str, example: str) -> None:
    counts[reason] += 1
    if len(examples.setdefault(reason, [])) < EXAMPLES_PER_REASON:
        examples[reason].append(example)


def collect(data_cfg: dict, cache_dir: Path) -> tuple[list[dict], dict]:
    """Kept rows (unique, in source order) and the per-source report."""
    strict = data_cfg["on_bad_row"] == "error"
    max_chars = data_cfg["max_chars"]
    seen: set[str] = set()
    rows: list[dict] = []
    report = {}
    for spec in data_cfg["sources"]:
        info = SourceInfo(label=spec["name"])
        dropped: Counter[str] = Counter()
        examples: dict[str, list[str]] = {}
        repaired: Counter[str] = Counter()
        repair_examples: dict[str, list[str]] = {}
        read = assistant_turns = 0
        by_domain: Counter[str] = Counter()
        for raw in read_source(spec, cache_dir, info):
            if spec.get("max_rows") is not None and read >= spec["max_rows"]:
                break
            read += 1
            turns, repairs, bad = _row_problem(raw, data_cfg["max_turns"], spec.get("template"))
            if bad is None and max_chars is not None:
                length = chars(turns)
                if length > max_chars:
                    bad = BadRow("too_long", f"{length} chars > max_chars={max_chars}")
            if bad is None:
                row_id = conversation_id(turns)
                if row_id in seen:
                    bad = BadRow("duplicate", f"id {row_id}")
            if bad is not None:
                if strict and bad.reason in MALFORMED:
                    raise DataError(
                        f"{raw.where}: {bad} (set data.on_bad_row: skip to count and skip)"
                    )
                _note(dropped, examples, bad.reason, f"{raw.where}: {bad}")
                continue
            for fix in repairs:
                _note(repaired, repair_examples, fix, raw.where)
            seen.add(row_id)
            assistant_turns += sum(t["role"] == "assistant" for t in turns)
            domain = domains.label(spec.get("domain", domains.AUTO), turns)
            by_domain[domain] += 1
            rows.append(
                {"id": row_id, "source": spec["name"], "domain": domain, "conversations": turns}
            )
        if info.truncated_tail_at is not None:
            dropped["truncated_tail"] += 1
            examples["truncated_tail"] = [
                f"{info.label}: file ends without closing the array after row "
                f"{info.truncated_tail_at - 1}; {info.truncated_tail_bytes} trailing bytes ignored"
            ]
        kept = read - sum(v for k, v in dropped.items() if k != "truncated_tail")
        report[spec["name"]] = {
            "file": info.label,
            "rows_read": read,
            "rows_kept": kept,
            "assistant_turns_kept": assistant_turns,
            # kept rows by domain (the source's label, or dflash.data.domains.classify's)
            "domains": dict(sorted(by_domain.items())),
            "dropped": dict(sorted(dropped.items())),
            "examples": dict(sorted(examples.items())),
            # rows kept after a repair, by kind (a row can have several)
            "repaired": dict(sorted(repaired.items())),
            "repair_examples": dict(sorted(repair_examples.items())),
        }
    return rows, report


def opening_prompt(row: dict) -> str:
    """What the held-out evaluation prompts with (a system turn, if any, and the first user
    turn), whitespace-collapsed. The target answers one prompt with one greedy answer, so two
    rows sharing it hold the same regenerated first answer."""
    turns = row["conversations"]
    system = [t["content"] for t in turns[:1] if t["role"] == "system"]
    first_user = [t["content"] for t in turns if t["role"] == "user"][:1]
    return normalized(" ".join(system + first_user))


def shuffled(rows: list[dict], seed: int) -> list[dict]:
    """Deterministic shuffle, independent of source order."""
    ordered = sorted(rows, key=lambda r: r["id"])
    random.Random(seed).shuffle(ordered)
    return ordered


def held_out_rows(ordered: list[dict], count: int, held_prompts: set[str]) -> list[dict]:
    """The first `count` rows of distinct opening prompts not yet held (`held_prompts` grows)."""
    held_out = []
    for row in ordered:
        if len(held_out) == count:
            break
        prompt = opening_prompt(row)
        if prompt not in held_prompts:
            held_prompts.add(prompt)
            held_out.append(row)
    return held_out


def split(rows: list[dict], seed: int, eval_rows: int | dict, train_rows: int | None):
    """Deterministic shuffle (independent of source order), then the held-out split: rows of
    distinct opening prompts, none of which a training row opens with. A shared prompt would put
    the held-out answer in the training data word for word (ShareGPT holds many reposted
    prompts: 4 of 24 held-out rows had one), and the drafter would be judged on text it learnt by
    heart; a training row holding a held-out prompt's middle 80 characters in any user turn (a
    repost with another opening: dflash/data/textmatch.py) is left out too. `eval_rows` per
    source ({sharegpt: 24, codeio: 16}) draws each source's rows from its own shuffle, in the
    mapping's order, so adding a source leaves the held-out rows of those before it as they were
    (with one source it equals `eval_rows: 24`). Returns (train, held_out, rows left out for
    sharing a held-out prompt)."""
    ordered = shuffled(rows, seed)
    held_prompts: set[str] = set()
    if isinstance(eval_rows, dict):
        held_out = []
        for source, count in eval_rows.items():
            own = [r for r in rows if r["source"] == source]
            held_out += held_out_rows(shuffled(own, seed), count, held_prompts)
    else:
        held_out = held_out_rows(ordered, eval_rows, held_prompts)
    chosen = {r["id"] for r in held_out}
    rest = [r for r in ordered if r["id"] not in chosen]
    # a held-out prompt reposted inside a training row, with another opening, counts too
    probes = {
        probe(t) for r in held_out for t in user_turns(r["conversations"])[:1] if searchable(t)
    }

    def reposts_held_out(row: dict) -> bool:
        text = "\n".join(user_turns(row["conversations"]))
        return any(p in text for p in probes)

    train = [r for r in rest if opening_prompt(r) not in held_prompts and not reposts_held_out(r)]
    overlap = len(rest) - len(train)
    if train_rows is not None:
        train = train[:train_rows]
    return train, held_out, overlap


def first_rows(train: list[dict], count: int | None, fraction: float) -> list[dict]:
    """The training rows kept: the first `count` (data.train_rows) of the shuffled rows, then the
    first `fraction` of those (data.train_fraction, at least one row). A smaller fraction keeps a
    prefix of a larger one's rows: a quarter of the data is part of the half (issue 57's τ
    against compute trains the same recipe on both)."""
    if count is not None:
        train = train[:count]
    if fraction < 1.0:
        train = train[: max(1, round(len(train) * fraction))]
    return train


def with_samples(train: list[dict], samples: int) -> list[dict]:
    """Each training row `samples` times (data.regenerate.samples), copy k > 0 with the id
    `<id>-s<k>`: regeneration keys its sampled stream by the id, so each copy gets an answer of
    its own. Copies follow their row (its shard too: a shard is chosen by the id's first 12 hex
    digits)."""
    if samples == 1:
        return train
    return [r if k == 0 else {**r, "id": f"{r['id']}-s{k}"} for r in train for k in range(samples)]


def write_rows(rows: list[dict], path: Path) -> None:
    schema = {"id": pl.String, "source": pl.String, "domain": pl.String}
    frame = pl.DataFrame(rows, schema={**schema, "conversations": CONVERSATION})
    frame.write_parquet(path, statistics=False)


def read_rows(path: Path) -> list[dict]:
    return pl.read_parquet(path).to_dicts()


def run(args) -> None:
    config = args.config
    data_cfg = config["data"]
    if not data_cfg.get("sources"):
        raise DataError("expand: data.sources is empty; list at least one source")
    check_sources(config, "expand")  # also run when the workflow is parsed
    eval_rows = data_cfg["eval_rows"]
    names = [spec["name"] for spec in data_cfg["sources"]]
    if isinstance(eval_rows, dict):  # in data.sources order, whatever order the keys came in
        eval_rows = {name: eval_rows[name] for name in names if name in eval_rows}
    rows, sources = collect(data_cfg, expand_user(config["cache_dir"]))
    train, held_out, overlap = split(rows, config["seed"], eval_rows, None)
    held_by_source = Counter(r["source"] for r in held_out)
    for name, count in eval_rows.items() if isinstance(eval_rows, dict) else ():
        if held_by_source[name] < count:
            log.warning(
                "expand: data.eval_rows.%s asks %d held-out rows, source %r gave %d (rows of "
                "distinct opening prompts)",
                name,
                count,
                name,
                held_by_source[name],
            )
    # the mixture: each domain's training rows capped, then the total (both after the shuffle)
    train, capped = domains.cap_rows(train, data_cfg["domain_rows"])
    train = first_rows(train, data_cfg["train_rows"], data_cfg["train_fraction"])
    samples = data_cfg["regenerate"]["samples"]
    if not train:
        raise DataError(f"expand: no training rows left; per-source report: {sources}")
    dropped, repaired = Counter(), Counter()
    for source in sources.values():
        dropped.update(source["dropped"])
        repaired.update(source["repaired"])
    report = {
        "sources": sources,
        "rows_unique": len(rows),
        "assistant_turns": sum(s["assistant_turns_kept"] for s in sources.values()),
        "dropped_total": dict(sorted(dropped.items())),
        "repaired_total": dict(sorted(repaired.items())),
        "train_rows": len(train) * samples,  # the rows written, copies included
        **({"samples": samples, "train_prompts": len(train)} if samples > 1 else {}),
        "eval_rows": len(held_out),
        "eval_rows_by_source": dict(sorted(held_by_source.items())),
        # rows per domain: kept (unique), in training, held out, left out by data.domain_rows
        "domains": {
            "rows": domains.counts(rows),
            "train": domains.counts(train),
            "eval": domains.counts(held_out),
            "capped": capped,
        },
        # rows opening with a held-out prompt: kept out of training (see `split`)
        "held_out_prompt_overlap": overlap,
        "not_selected": len(rows) - len(train) - len(held_out) - overlap,
        "seed": config["seed"],
    }
    with atomic_path(args.train) as t, atomic_path(args.eval) as e:
        write_rows(with_samples(train, samples), t)
        write_rows(held_out, e)
    write_json(args.report, report)
    log.info(
        "expand: %d unique rows -> %d train, %d eval; repaired %s; dropped %s",
        len(rows),
        len(train),
        len(held_out),
        dict(repaired),
        dict(dropped),
    )
