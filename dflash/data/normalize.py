"""Normalise the common chat-data shapes to `{id, conversations: [{role, content}]}`.

Accepted shapes: ShareGPT (`conversations` of `{from, value}`), OpenAI (`messages` of
`{role, content}`, content a string or a list of text parts) and Alpaca (`instruction`,
optional `input`, `output`, optional `system`). The id is a hash of the normalised content, so
the same conversation gets the same id in every source and every run.
"""

from __future__ import annotations

import hashlib
import json

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


def _turns(messages, role_key: str, content_key: str, field: str) -> list[dict]:
    if not isinstance(messages, list):
        raise BadRow("wrong_shape", f"'{field}' must be a list, got {type(messages).__name__}")
    turns = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise BadRow("wrong_shape", f"{where} must be an object")
        for key in (role_key, content_key):
            if key not in message:
                raise BadRow("missing_key", f"{where} has no '{key}'")
        role = ROLES.get(str(message[role_key]).lower())
        if role is None:
            raise BadRow("unknown_role", f"{where}: {message[role_key]!r}")
        turns.append({"role": role, "content": _text(message[content_key], where)})
    return turns


def to_turns(record: dict) -> list[dict]:
    """The record's turns in order, whatever its shape."""
    if "conversations" in record:
        return _turns(record["conversations"], "from", "value", "conversations")
    if "messages" in record:
        return _turns(record["messages"], "role", "content", "messages")
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


def repair(turns: list[dict]) -> tuple[list[dict], list[str]]:
    """Fix what can be fixed without guessing, and name each fix.

    - `blank_turn_removed`: a turn with only whitespace says nothing;
    - `leading_assistant_dropped`: a conversation that opens with the assistant (after an optional
      system turn) starts at its first user turn: the assistant's opener answers no prompt;
    - `same_role_merged`: consecutive turns of one role (a message split in two, a follow-up sent
      before the reply) become one turn, joined by a blank line.
    """
    fixes = []
    kept = [t for t in turns if t["content"].strip()]
    if len(kept) < len(turns):
        fixes.append("blank_turn_removed")
    system = kept[:1] if kept and kept[0]["role"] == "system" else []
    dialog = kept[len(system) :]
    first_user = next((i for i, t in enumerate(dialog) if t["role"] == "user"), len(dialog))
    if first_user and any(t["role"] == "assistant" for t in dialog[:first_user]):
        fixes.append("leading_assistant_dropped")
    merged: list[dict] = []
    for turn in dialog[first_user:]:
        if merged and merged[-1]["role"] == turn["role"] != "system":
            merged[-1] = {
                "role": turn["role"],
                "content": f"{merged[-1]['content']}\n\n{turn['content']}",
            }
            if "same_role_merged" not in fixes:
                fixes.append("same_role_merged")
        else:
            merged.append(dict(turn))
    return system + merged, fixes


def clean(turns: list[dict], max_turns: int | None) -> tuple[list[dict], list[str]]:
    """Repair (see `repair`), check turn order and keep at most `max_turns` user/assistant rounds;
    returns the turns and the repairs made.

    Valid: an optional leading system turn, then alternating user/assistant turns starting with
    user. A trailing user turn without a reply is dropped (nothing to learn from it).
    """
    if not turns or all(not t["content"].strip() for t in turns):
        raise BadRow("empty")
    turns, fixes = repair(turns)
    system = turns[:1] if turns and turns[0]["role"] == "system" else []
    dialog = turns[len(system) :]
    for i, turn in enumerate(dialog):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] != expected:  # e.g. a system turn in mid-conversation
            raise BadRow(
                "bad_turn_order", f"turn {i + len(system)} is {turn['role']}, expected {expected}"
            )
    rounds = len(dialog) // 2
    if rounds == 0:
        raise BadRow("no_assistant")
    if max_turns is not None:
        rounds = min(rounds, max_turns)
    return system + dialog[: 2 * rounds], fixes


def conversation_id(turns: list[dict]) -> str:
    canonical = json.dumps(turns, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canonical.encode("utf-8", errors="surrogatepass")).hexdigest()[:20]
