"""Tool-calling conversations (OpenAI's shape: an assistant turn with `tool_calls` and
`content: null`, then a `tool` message): read, ordered and rendered by the target's own chat
template, the assistant's text and calls trained on and tool results as context; a template that
cannot render calls leaves them out, counted (they were all dropped as `wrong_shape`)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import polars as pl
import pytest

from dflash.data import tokenization, tools
from dflash.data.expand import collect, write_rows
from dflash.data.generation import Conversation
from dflash.data.normalize import BadRow, clean, to_turns
from dflash.data.tokenization import encode

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_ROW = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
}


def test_an_openai_tool_call_turn_is_read_with_its_calls_and_the_tool_result():
    turns, fixes = clean(to_turns(TOOL_ROW), None)
    assert [t["role"] for t in turns] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert fixes == []  # the empty call turn is not "blank", the tool turn not merged
    call = json.loads(turns[1]["extra"])["tool_calls"][0]
    # arguments as a mapping, as chat templates take them (OpenAI sends a JSON string)
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert json.loads(turns[0]["extra"])["tools"][0]["function"]["name"] == "get_weather"
    assert json.loads(turns[2]["extra"]) == {"tool_call_id": "call_1"}
    messages, defined = tools.chat_messages(turns)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert "tool_calls" not in messages[3] and defined[0]["function"]["name"] == "get_weather"


def test_plain_conversations_keep_their_ids():
    """No `extra` on a plain turn: ids (and so the shuffle and the held-out split) unchanged."""
    turns, _ = clean(to_turns({"messages": TOOL_ROW["messages"][4:]}), None)
    assert turns == [
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ]


@pytest.mark.parametrize(
    "messages, reason",
    [
        # a call followed by the user, not by its result
        ([("user", "q"), ("assistant", None, [CALL]), ("user", "r")], "bad_turn_order"),
        # a tool result with no call before it
        ([("user", "q"), ("tool", "r"), ("assistant", "a")], "bad_turn_order"),
        # arguments that are not JSON
        (
            [
                ("user", "q"),
                ("assistant", None, [{**CALL, "function": {"name": "f", "arguments": "{"}}]),
            ],
            "wrong_shape",
        ),
    ],
)
def test_malformed_tool_conversations_are_named(messages, reason):
    record = {
        "messages": [
            {"role": m[0], "content": m[1], **({"tool_calls": m[2]} if len(m) > 2 else {})}
            for m in messages
        ]
    }
    with pytest.raises(BadRow) as bad:
        clean(to_turns(record), None)
    assert bad.value.reason == reason


def test_a_conversation_ends_at_its_last_assistant_turn():
    """Trailing tool results without the answer are cut; the call before them is kept."""
    turns, _ = clean(to_turns({"messages": TOOL_ROW["messages"][:3]}), None)
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert tools.has_calls(turns[-1])
    one_round, _ = clean(to_turns(TOOL_ROW), max_turns=1)
    assert [t["role"] for t in one_round] == ["user", "assistant", "tool", "assistant"]


def test_expand_keeps_tool_calling_rows_it_dropped_as_wrong_shape(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(TOOL_ROW) + "\n")
    data = {"sources": [{"name": "own", "path": str(path)}], "on_bad_row": "error"}
    data |= {"max_turns": None, "max_chars": None}
    rows, report = collect(data, tmp_path)
    assert report["own"]["rows_kept"] == 1 and report["own"]["dropped"] == {}
    write_rows(rows, tmp_path / "rows.parquet")  # the stored struct holds `extra`
    back = pl.read_parquet(tmp_path / "rows.parquet").to_dicts()[0]["conversations"]
    assert back[1]["extra"] == rows[0]["conversations"][1]["extra"]
    assert back[0]["extra"] is not None  # the row's tools, on its first turn


def trained_text(tokenizer, ids, mask) -> list[str]:
    runs, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_qwen3_renders_calls_trained_on_and_results_as_context(qwen3_tokenizer):
    turns, _ = clean(to_turns(TOOL_ROW), None)
    assert tools.template_drops_calls(qwen3_tokenizer) is None
    ids, mask, _ = encode(qwen3_tokenizer, turns, set(), 1024)
    runs = trained_text(qwen3_tokenizer, ids, mask)
    assert len(runs) == 3
    assert '"name": "get_weather"' in runs[0] and '"city": "Paris"' in runs[0]
    assert runs[0].endswith("</tool_call><|im_end|>")
    assert runs[1] == "It is 18 C and sunny in Paris.<|im_end|>"
    text = qwen3_tokenizer.decode(ids)
    assert "temp_c" in text and "temp_c" not in "".join(runs)
    assert "get_weather" in text.split("<|im_start|>user")[0]  # tools in the system prompt


def test_regeneration_keeps_calls_and_rewrites_plain_answers():
    turns, _ = clean(to_turns(TOOL_ROW), None)
    conv = Conversation({"id": "x", "source": "s", "conversations": turns})
    assert conv.todo == [3, 5]  # the answers; the call turn (1) stays as the data has it


def test_a_template_without_tool_calls_leaves_those_rows_out_counted(
    tokenizer, target_dir, tmp_path
):
    """SmolLM2's template prints only `content`: a call would vanish from its render."""
    assert "leaves tool calls" in tools.template_drops_calls(tokenizer)
    tool_turns, _ = clean(to_turns(TOOL_ROW), None)
    plain, _ = clean(to_turns({"messages": TOOL_ROW["messages"][4:]}), None)
    rows = [{"id": "tools", "conversations": tool_turns}, {"id": "plain", "conversations": plain}]
    write_rows([r | {"source": "own", "domain": "chat"} for r in rows], tmp_path / "in.parquet")
    conv = Conversation(pl.read_parquet(tmp_path / "in.parquet").to_dicts()[0])
    assert conv.prompt(tokenizer, 512) is None and conv.todo == []  # not regenerated
    args = Namespace(
        config={"data": {"max_length": 256, "num_proc": 1}},
        input=tmp_path / "in.parquet",
        target=Path(target_dir),
        output=tmp_path / "out.parquet",
        manifest=None,
    )
    tokenization.run(args)
    assert pl.read_parquet(args.output)["id"].to_list() == ["plain"]
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["dropped"] == {"no_trainable_pair": 0, "tool_calls_not_rendered": 1}
    assert (
        "row id tools: tool_calls_not_rendered: the chat template leaves"
        in (report["dropped_examples"]["tool_calls_not_rendered"])
    )
