"""tokenize: render conversations with the target's chat template and build the loss mask.

Trainable tokens are each assistant turn's content plus its end-of-turn token(s): the drafter
learns to predict exactly what the target emits after the generation prompt. A turn cut off at
`max_new_tokens` keeps its content but not the end-of-turn, which the target never produced there.
Spans are found in characters (prefix renders of the template) and mapped to tokens with the fast
tokenizer's offsets, so any template that renders earlier turns unchanged works.
"""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl

from dflash.data.bounded import encode_bounded
from dflash.data.sources import DataError
from dflash.io import atomic_path, write_json
from dflash.manifest import write_manifest

log = logging.getLogger(__name__)


def _render(tokenizer, turns, generation_prompt=False, template=None) -> str:
    """The conversation as text; `template`: extra chat-template arguments (e.g. Qwen3's
    enable_thinking, `data.chat_template_kwargs`), as regeneration rendered its prompts."""
    return tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=generation_prompt, **(template or {})
    )


def assistant_spans(
    tokenizer,
    turns: list[dict],
    truncated: set[int],
    generation_prompt: bool = False,
    template: dict | None = None,
) -> tuple[str, list]:
    """The rendered text and the [start, end) character span of each assistant turn.

    A turn starts where the generation prompt of the turns before it ends, which the full render
    must begin with. It ends where the render of the conversation up to it ends, when the full
    render begins with that too. Some templates render a turn differently when it is the last
    one (Qwen3 wraps it in an empty think block and strips reasoning from earlier ones): then
    its end is found in the full render, as the turn's final words followed by the end-of-turn
    text, the last such place before the next assistant turn's prompt.
    """
    full = _render(tokenizer, turns, generation_prompt, template)
    starts = {}
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant":
            prefix = _render(tokenizer, turns[:i], generation_prompt=True, template=template)
            if not full.startswith(prefix):
                raise DataError(
                    f"turn {i}: the chat template renders earlier turns differently once later "
                    "turns are added, so assistant spans cannot be located"
                )
            starts[i] = len(prefix)
    bounds = [*list(starts.values())[1:], len(full)][: len(starts)]  # each turn's region ends
    spans = []
    for (i, start), bound in zip(starts.items(), bounds, strict=True):
        content = turns[i]["content"]
        upto = _render(tokenizer, turns[: i + 1], template=template)
        closed = upto.rstrip()  # content + end-of-turn, without the template's trailing newline
        if full.startswith(upto):
            end = len(closed)
            if i in truncated:  # content only: the target never emitted the end-of-turn here
                found = upto.find(content, start) if content else start
                if found < 0:
                    raise DataError(f"turn {i}: the chat template altered the assistant content")
                end = found + len(content)
        else:
            words = content.rstrip()[-32:]  # the turn's final words, as any template keeps them
            eot = "" if i in truncated else closed[closed.rfind(words) + len(words) :]
            found = full.rfind(words + eot, start, bound) if words else -1
            if found < 0:
                raise DataError(
                    f"turn {i}: the chat template renders this turn differently as the last "
                    "one, and its end cannot be found in the full conversation"
                )
            end = found + len(words) + len(eot)
        spans.append((start, end))
    return full, spans


def encode(
    tokenizer,
    turns: list[dict],
    truncated: set[int],
    max_length: int,
    last_turn_ids: list[int] | None = None,
    template: dict | None = None,
):
    """input ids, loss mask, and whether the row was cut to max_length.

    With `last_turn_ids` (the ids the target generated for the final assistant turn, stop token
    included if it finished), the row is the prompt exactly as the target saw it (template-
    tokenized history + generation prompt) followed by those ids, all trainable. Re-encoding the
    decoded text instead would split some tokens differently from what the target emits (e.g.
    "\n\n" + "1" re-encodes as "\n", "\n", "1"), teaching the drafter sequences the target
    never produces. Earlier assistant turns are located in the text either way.
    """
    history = turns if last_turn_ids is None else turns[:-1]

    def tokenized(short):  # huge messages cut by characters first (dflash.data.bounded)
        generated = last_turn_ids is not None
        text, spans = assistant_spans(tokenizer, short, truncated, generated, template)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return (enc, spans), len(enc["input_ids"])

    (enc, spans), _ = encode_bounded(tokenized, history, max_length)
    tail = [] if last_turn_ids is None else list(last_turn_ids)
    ids = enc["input_ids"] + tail
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in enc["offset_mapping"]]
    mask += [1] * len(tail)
    return ids[:max_length], mask[:max_length], len(ids) > max_length


def has_trainable_pair(mask: list[int]) -> bool:
    return any(a and b for a, b in zip(mask, mask[1:], strict=False))


def tokenize_rows(
    frame: pl.DataFrame, tokenizer_dir: Path, max_length: int, num_proc: int, template=None
):
    import datasets
    from transformers import AutoTokenizer

    if "truncated_turns" not in frame.columns:  # not regenerated: original responses
        frame = frame.with_columns(
            pl.lit([], dtype=pl.List(pl.Int32)).alias("truncated_turns"),
            pl.lit([], dtype=pl.List(pl.List(pl.Int32))).alias("turn_token_ids"),
        )

    def tokenize_one(row):
        tokenizer = _tokenizer(str(tokenizer_dir), AutoTokenizer)
        try:
            generated = row["turn_token_ids"]
            ids, mask, cut = encode(
                tokenizer,
                row["conversations"],
                set(row["truncated_turns"]),
                max_length,
                last_turn_ids=generated[-1] if generated else None,
                template=template,
            )
        except DataError as e:
            raise DataError(f"row id {row['id']}: {e}") from e
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "length": len(ids),
            "trainable": sum(mask),
            "keep": has_trainable_pair(mask),
            "cut": cut,
        }

    columns = ["id", "conversations", "truncated_turns", "turn_token_ids"]
    ds = datasets.Dataset.from_polars(frame.select(columns))
    ds = ds.map(
        tokenize_one,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=columns[1:],
        keep_in_memory=True,
        desc="tokenize",
    )
    out = pl.from_arrow(ds.data.table).with_columns(
        pl.col("input_ids").cast(pl.List(pl.Int32)),
        pl.col("loss_mask").cast(pl.List(pl.Int8)),
        pl.col("length").cast(pl.Int32),
        pl.col("trainable").cast(pl.Int32),
    )
    return out


_TOKENIZERS: dict = {}


def _tokenizer(path: str, auto):
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = auto.from_pretrained(path)
    return _TOKENIZERS[path]


def run(args) -> None:
    data_cfg = args.config["data"]
    frame = pl.read_parquet(args.input)
    if frame.height == 0:
        raise DataError(f"{args.input}: no rows to tokenize")
    template = data_cfg.get("chat_template_kwargs") or {}
    out = tokenize_rows(frame, args.target, data_cfg["max_length"], data_cfg["num_proc"], template)
    kept = out.filter(pl.col("keep")).drop("keep", "cut")
    report = {
        "rows_in": frame.height,
        "rows_out": kept.height,
        "dropped": {"no_trainable_pair": out.height - kept.height},
        "truncated_to_max_length": int(out["cut"].sum()),
        "max_length": data_cfg["max_length"],
    }
    if kept.height == 0:
        raise DataError(f"{args.input}: no row has two consecutive trainable tokens")
    with atomic_path(args.output) as tmp:
        kept.write_parquet(tmp, statistics=False)
    report_path = args.output.with_suffix(".report.json")
    write_json(report_path, report)
    log.info("tokenize: %s", report)
    if args.manifest:
        write_manifest(
            args.manifest,
            "tokenize",
            {"input": args.input, "target": args.target},
            {"output": args.output, "report": report_path},
            params={"max_length": data_cfg["max_length"], "chat_template_kwargs": template},
            code=(__name__,),
        )
