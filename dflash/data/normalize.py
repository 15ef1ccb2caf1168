"""Normalise the common chat-data shapes to `{id, conversations: [{role, content}]}`.

Accepted shapes: ShareGPT (`conversations` of `{from, value}`), OpenAI (`messages` of
`{role, content}`, content a string or a list of text parts; tool calls and `tool` results as
`dflash.data.tools` reads them) and Alpaca (`instruction`, optional `input`, `output`, optional
`system`). The id is a hash of the normalised content, so the same conversation gets the same id
in every source and every run.
"""

from __future__ import annotations

import hashlib
import json

from dflash.data import tools

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
    **tools.TOOL_ROLES,
}


class BadRow(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRow("wrong_shape", f"{where}: only text content parts are supported")
            parts.append(_text(part.get("text"), where))
        return "".join(parts)
    raise BadRow("wrong_shape", f"{where}: content must be a string, got {type(value).__name__}")


def _turns(messages, role_key: str, content_key: str, field: str, record=None) -> list[dict]:
    if not isinstance(messages, list):
        raise BadRow("wrong_shape", f"'{field}' must be a list, got {type(messages).__name__}")
    turns = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise BadRow("wrong_shape", f"{where} must be an object")
        if role_key not in message:
            raise BadRow("missing_key", f"{where} has no '{role_key}'")
        role = ROLES.get(str(message[role_key]).lower())
        if role is None:
            raise BadRow("unknown_role", f"{where}: {message[role_key]!r}")
        try:
            extra = tools.extra_of(message, role, where)
            if i == 0 and record is not None and (defined := tools.row_tools(record)):
                extra["tools"] = defined
        except tools.ToolShapeError as e:
            raise BadRow("wrong_shape", str(e)) from None
        content = message.get(content_key)
        if content_key not in message and not extra.get("tool_calls"):
            raise BadRow("missing_key", f"{where} has no '{content_key}'")
        turn = {"role": role, "content": "" if content is None and extra else _text(content, where)}
        if extra:
            turn["extra"] = json.dumps(extra, ensure_ascii=False, sort_keys=True)
        turns.append(turn)
    return turns


def to_turns(record: dict) -> list[dict]:
    """The record's turns in order, whatever its shape."""
    if "conversations" in record:
        return _turns(record["conversations"], "from", "value", "conversations")
    if "messages" in record:
        return _turns(record["messages"], "role", "content", "messages", record)
    if "instruction" in record or "output" in record:
        for key in ("instruction", "output"):
            if key not in record:
                raise BadRow("missing_key", f"alpaca row has no '{key}'")
        prompt = _text(record["instruction"], "instruction")
        extra = _text(record.get("input") or "", "input")
        turns = (
            [{"role": "system", "content": _text(record["system"], "system")}]
            if record.get("system")
            else []
        )
        turns.append(
            {"role": "user", "content": f"{prompt}\n\n{extra}" if extra.strip() else prompt}
        )
        turns.append({"role": "assistant", "content": _text(record["output"], "output")})
        return turns
    raise BadRow(
        "unknown_shape",
        f"keys {sorted(record)[:8]}: expected 'conversations', 'messages' or 'instruction'/'output'",
    )


class _Fields(dict):
    def __missing__(self, key):
        raise BadRow("missing_key", f"template field {{{key}}}: the row has no '{key}'")


def from_template(record: dict, template: dict) -> dict:
    """An OpenAI-shaped row from a prompt set's fields: `template` maps `user` (and optionally
    `system`, `assistant`) to text with `{field}` placeholders, e.g. `{user: "{question}"}`.
    Without `assistant` the reply is a placeholder: regeneration writes the target's own."""
    fields = _Fields({k: v if isinstance(v, str) else json.dumps(v) for k, v in record.items()})
    messages = [
        {"role": role, "content": template[role].format_map(fields)}
        for role in ("system", "user")
        if role in template
    ]
    reply = template["assistant"].format_map(fields) if "assistant" in template else "…"
    return {"messages": [*messages, {"role": "assistant", "content": reply}]}


def _blank(turn: dict) -> bool:
    """Says nothing: only whitespace, no tool call, not a tool's result (which may be empty)."""
    return not turn["content"].strip() and not turn.get("extra") and turn["role"] != "tool"


def _mergeable(a: dict, b: dict) -> bool:
    """Two turns of one speaker that are one message: user or assistant text, no tool call."""
    return a["role"] == b["role"] in ("user", "assistant") and not (
        tools.has_calls(a) or tools.has_calls(b)
    )


def repair(turns: list[dict]) -> tuple[list[dict], list[str]]:
    """Fix what can be fixed without guessing, and name each fix.

    - `blank_turn_removed`: a turn with only whitespace says nothing (a tool call without text,
      and a tool's result, do);
    - `leading_assistant_dropped`: a conversation that opens with the assistant (after an optional
      system turn) starts at its first user turn: the assistant's opener answers no prompt;
    - `same_role_merged`: consecutive user or assistant turns (a message split in two, a
      follow-up sent before the reply) become one turn, joined by a blank line; turns with tool
      calls and tool results stay apart (one result per call).
    """
    fixes = []
    kept = [t for t in turns if not _blank(t)]
    if len(kept) < len(turns):
        fixes.append("blank_turn_removed")
    system = kept[:1] if kept and kept[0]["role"] == "system" else []
    dialog = kept[len(system) :]
    first_user = next((i for i, t in enumerate(dialog) if t["role"] == "user"), len(dialog))
    if first_user and any(t["role"] == "assistant" for t in dialog[:first_user]):
        fixes.append("leading_assistant_dropped")
    merged: list[dict] = []
    for turn in dialog[first_user:]:
        if merged and _mergeable(merged[-1], turn):
            last = merged[-1]
            merged[-1] = {**last, "content": f"{last['content']}\n\n{turn['content']}"}
            if "extra" in turn and "extra" not in last:  # the row's tools, on a split message
                merged[-1]["extra"] = turn["extra"]
            if "same_role_merged" not in fixes:
                fixes.append("same_role_merged")
        else:
            merged.append(dict(turn))
    return system + merged, fixes


def _expected(previous: dict | None) -> tuple[str, ...]:
    """The roles that may follow a turn: user opens, the assistant answers, a tool call is
    followed by its results, the results by more results or the assistant."""
    if previous is None or (previous["role"] == "assistant" and not tools.has_calls(previous)):
        return ("user",)
    if previous["role"] == "user":
        return ("assistant",)
    if previous["role"] == "assistant":
        return ("tool",)
    return ("tool", "assistant")  # after a tool's result


def clean(turns: list[dict], max_turns: int | None) -> tuple[list[dict], list[str]]:
    """Repair (see `repair`), check turn order and keep at most `max_turns` rounds (a user turn
    and what answers it); returns the turns and the repairs made.

    Valid: an optional leading system turn, then user and assistant turns in turn, starting with
    user; an assistant turn with tool calls is followed by their results (`tool` turns), and
    those by the assistant. The conversation ends with its last assistant turn: a trailing user
    turn or tool result has no reply to learn from.
    """
    if not turns or all(_blank(t) for t in turns):
        raise BadRow("empty")
    turns, fixes = repair(turns)
    system = turns[:1] if turns and turns[0]["role"] == "system" else []
    dialog = turns[len(system) :]
    for i, turn in enumerate(dialog):
        expected = _expected(dialog[i - 1] if i else None)
        if turn["role"] not in expected:  # e.g. a system turn in mid-conversation
            raise BadRow(
                "bad_turn_order",
                f"turn {i + len(system)} is {turn['role']}, expected {' or '.join(expected)}",
            )
    users = [i for i, t in enumerate(dialog) if t["role"] == "user"]
    if max_turns is not None and len(users) > max_turns:
        dialog = dialog[: users[max_turns]]
    answers = [i for i, t in enumerate(dialog) if t["role"] == "assistant"]
    if not answers:
        raise BadRow("no_assistant")
    return system + dialog[: answers[-1] + 1], fixes


def chars(turns: list[dict]) -> int:
    """A conversation's length for `data.max_chars`: its text and its tool calls' JSON."""
    return sum(len(t["content"]) + len(t.get("extra") or "") for t in turns)


def conversation_id(turns: list[dict]) -> str:
    canonical = json.dumps(turns, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canonical.encode("utf-8", errors="surrogatepass")).hexdigest()[:20]
