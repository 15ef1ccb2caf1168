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

from dflash.data import tools
from dflash.data.bounded import encode_bounded
from dflash.data.sources import DataError
from dflash.io import atomic_path, write_json

log = logging.getLogger(__name__)


def _render(tokenizer, turns, generation_prompt=False, template=None) -> str:
    """The conversation as text, tool calls and results included (`dflash.data.tools`);
    `template`: extra chat-template arguments (e.g. Qwen3's enable_thinking,
    `data.chat_template_kwargs`), as regeneration rendered its prompts."""
    return tools.render(tokenizer, turns, generation_prompt, **(template or {}))


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
            words, eot = _turn_tail(tokenizer, content, closed, i in truncated)
            found = full.rfind(words + eot, start, bound) if words else -1
            if found < 0:
                raise DataError(
                    f"turn {i}: the chat template renders this turn differently as the last "
                    "one, and its end cannot be found in the full conversation"
                )
            end = found + len(words) + len(eot)
        spans.append((start, end))
    return full, spans


def _turn_tail(tokenizer, content: str, closed: str, truncated: bool) -> tuple[str, str]:
    """A turn's final words, as any template keeps them, and the end-of-turn text after them in
    `closed` (its render as the last turn). A turn of tool calls without text ends with the
    last words of its calls' render."""
    if content.strip():
        words = content.rstrip()[-32:]
        return words, "" if truncated else closed[closed.rfind(words) + len(words) :]
    eot = _end_of_turn(tokenizer)
    eot = eot if eot and closed.endswith(eot) else ""
    return closed[: len(closed) - len(eot)][-32:], eot


def _end_of_turn(tokenizer) -> str:
    """What the template writes after an assistant turn's text ("<|im_end|>" for ChatML)."""
    marker = "dflash-end-of-turn-marker"
    text = _render(
        tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    )
    return text[text.rfind(marker) + len(marker) :].rstrip()


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


# a row is a loop when this share of its trainable tokens repeats one of the LOOP_SPAN before
# it: natural answers measured 4 % (median), 19 % (p99) and 48 % (max) of 1,332 ShareGPT answers
# in SmolLM2's tokens; a random target's "lessnesslessness..." 94 % and more
LOOP_SHARE, LOOP_SPAN, LOOP_MIN_TOKENS = 0.8, 4, 8


def repetitive(ids: list[int], mask: list[int]) -> bool:
    """The row's trainable tokens (at least LOOP_MIN_TOKENS) are a loop of a few tokens: what a
    degenerate target regenerates ("the the the", "lessnesslessness"), on which τ says
    nothing (a drafter that repeats is right almost every time)."""
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    if len(trained) < LOOP_MIN_TOKENS:
        return False
    span = LOOP_SPAN
    repeats = sum(trained[k] in trained[k - span : k] for k in range(span, len(trained)))
    return repeats >= LOOP_SHARE * (len(trained) - span)


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
        turns = row["conversations"]
        if tools.uses_tools(turns) and (why := _drops_calls(str(tokenizer_dir), tokenizer)):
            return _left_out(f"tool_calls_not_rendered: {why}")
        generated = row["turn_token_ids"]
        # the target's own ids stand for the last turn when it was regenerated: a plain answer
        # (a turn with tool calls is kept as the data has it), not a turn cut off before it
        last = turns[-1]
        regenerated_last = bool(generated) and last["role"] == "assistant"
        try:
            ids, mask, cut = encode(
                tokenizer,
                turns,
                set(row["truncated_turns"]),
                max_length,
                last_turn_ids=generated[-1]
                if regenerated_last and not tools.has_calls(last)
                else None,
                template=template,
            )
        except DataError as e:
            if tools.uses_tools(turns):  # one template's way with one conversation's calls
                return _left_out(f"tool_calls_not_rendered: {e}")
            raise DataError(f"row id {row['id']}: {e}") from e
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "length": len(ids),
            "trainable": sum(mask),
            "keep": has_trainable_pair(mask),
            "cut": cut,
            "repetitive": repetitive(ids, mask),
            "left_out": "",
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


def _left_out(reason: str) -> dict:
    return {"input_ids": [], "loss_mask": [], "length": 0, "trainable": 0, "keep": False,
            "cut": False, "repetitive": False, "left_out": reason}  # fmt: skip


_TOKENIZERS: dict = {}
_DROPS_CALLS: dict = {}


def _drops_calls(path: str, tokenizer) -> str | None:
    """Why the target's template cannot render tool calls (None: it can), once per process."""
    if path not in _DROPS_CALLS:
        _DROPS_CALLS[path] = tools.template_drops_calls(tokenizer)
    return _DROPS_CALLS[path]


def _tokenizer(path: str, auto):
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = auto.from_pretrained(path)
    return _TOKENIZERS[path]


def run(args) -> dict | None:
    data_cfg = args.config["data"]
    frame = pl.read_parquet(args.input)
    if frame.height == 0:
        raise DataError(f"{args.input}: no rows to tokenize")
    template = data_cfg.get("chat_template_kwargs") or {}
    out = tokenize_rows(frame, args.target, data_cfg["max_length"], data_cfg["num_proc"], template)
    kept = out.filter(pl.col("keep")).drop("keep", "cut", "repetitive", "left_out")
    left_out = out.filter(pl.col("left_out") != "").with_columns(
        reason=pl.col("left_out").str.split(": ").list.get(0)
    )
    # rows left out by reason, each with its first row's words
    reasons = left_out.group_by("reason", maintain_order=True).agg(
        pl.len(), pl.col("left_out").first(), pl.col("id").first()
    )
    report = {
        "rows_in": frame.height,
        "rows_out": kept.height,
        "dropped": {
            "no_trainable_pair": out.height - kept.height - left_out.height,
            **{r["reason"]: r["len"] for r in reasons.iter_rows(named=True)},
        },
        "dropped_examples": {
            r["reason"]: f"row id {r['id']}: {r['left_out']}" for r in reasons.iter_rows(named=True)
        },
        "truncated_to_max_length": int(out["cut"].sum()),
        "max_length": data_cfg["max_length"],
        # kept rows whose answers loop over a few tokens (a degenerate target's, see
        # `repetitive`): results/summary.md warns when they are many
        "repetitive_rows": int(out.filter(pl.col("keep"))["repetitive"].sum()),
    }
    if kept.height == 0:
        raise DataError(f"{args.input}: no row has two consecutive trainable tokens")
    with atomic_path(args.output) as tmp:
        kept.write_parquet(tmp, statistics=False)
    report_path = args.output.with_suffix(".report.json")
    write_json(report_path, report)
    log.info("tokenize: %s", report)
    return {"outputs": {"report": report_path}}
