"""Tool-calling conversations: OpenAI's shape read into turns, and turns back into the messages a
chat template renders.

An OpenAI tool-calling conversation holds an assistant message with `tool_calls` (often with
`content: null`), then one `tool` message per call with its result, then the assistant's answer;
the row may list the functions under `tools`. A turn keeps `role` and `content` (text, "" for a
call without text) and, where there is more, `extra`: JSON of the message keys a template reads
(`tool_calls`, `tool_call_id`, `name`; on the first turn the row's `tools`). Plain turns carry
no `extra`, so their conversation ids are those of before tool calls were read.

What a target learns from them: the assistant's text and calls (rendered by its own template),
with the tool results as context. Regeneration keeps a turn with calls as the data has it and
rewrites only plain answers. A template that cannot render calls (it raises, or drops them:
SmolLM2's prints only `content`) leaves its conversations out, counted by tokenize.
"""

from __future__ import annotations

import json

from dflash.errors import UserError

TOOL_ROLES = {"tool": "tool", "function": "tool", "ipython": "tool"}
MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")
# a sample call: where the template's render does not hold its name, the template drops calls
PROBE_NAME = "dflash_probe_function"


class ToolShapeError(ValueError):
    """A tool call that is not OpenAI's shape (`normalize` counts it as wrong_shape)."""


def _arguments(value, where: str):
    """A call's arguments as a mapping, as chat templates take them (OpenAI sends a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolShapeError(f"{where}.arguments is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ToolShapeError(f"{where}.arguments must be an object, got {type(value).__name__}")
    return value


def tool_calls(message: dict, where: str) -> list[dict] | None:
    """The message's calls in OpenAI's shape (`tool_calls`, or the older `function_call`), with
    arguments as mappings; None when it makes none."""
    calls = message.get("tool_calls")
    if calls is None and isinstance(message.get("function_call"), dict):
        calls = [{"type": "function", "function": message["function_call"]}]
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise ToolShapeError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolShapeError(
                f"{at}: expected {{type: function, function: {{name, arguments}}}}"
            )
        entry = {"type": "function", "function": {"name": fn["name"]}}
        entry["function"]["arguments"] = _arguments(fn.get("arguments", {}), f"{at}.function")
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        out.append(entry)
    return out


def extra_of(message: dict, role: str, where: str) -> dict:
    """The keys beyond role and content that a template reads, for a normalised turn."""
    extra = {}
    if role == "assistant":
        calls = tool_calls(message, where)
        if calls:
            extra["tool_calls"] = calls
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                extra[key] = str(message[key])
    return extra


def row_tools(record: dict) -> list | None:
    """The row's function definitions (`tools`), when it lists any."""
    tools = record.get("tools")
    if tools in (None, []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ToolShapeError("'tools' must be a list of function definitions")
    return tools


def extra(turn: dict) -> dict:
    raw = turn.get("extra")
    return json.loads(raw) if raw else {}


def has_calls(turn: dict) -> bool:
    return turn["role"] == "assistant" and "tool_calls" in extra(turn)


def uses_tools(turns: list[dict]) -> bool:
    return any(t["role"] == "tool" or t.get("extra") for t in turns)


def chat_messages(turns: list[dict]) -> tuple[list[dict], list | None]:
    """(messages, tools) for `apply_chat_template(messages, tools=tools)`: each turn's role and
    content plus its `extra` keys; no key a template might test for (`'tool_calls' in message`)
    is present unless it holds something."""
    messages, tools = [], None
    for turn in turns:
        keys = extra(turn)
        tools = keys.pop("tools", tools)
        messages.append({"role": turn["role"], "content": turn["content"], **keys})
    return messages, tools


def render(
    tokenizer, turns: list[dict], generation_prompt: bool, tokenize: bool = False, **template
):
    """The target's chat template over normalised turns (tool calls and results included);
    `template`: its extra arguments (`data.chat_template_kwargs`)."""
    messages, tools = chat_messages(turns)
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=tokenize, add_generation_prompt=generation_prompt, **kwargs, **template
    )


def template_drops_calls(tokenizer) -> str | None:
    """Why the target's template cannot render tool calls (it raises, or leaves a call out of
    its render), or None when it renders them."""
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": {"x": 1}}}
    turns = [
        {"role": "user", "content": "Call the function."},
        {"role": "assistant", "content": "", "extra": json.dumps({"tool_calls": [call]})},
        {"role": "tool", "content": "42", "extra": json.dumps({"name": PROBE_NAME})},
        {"role": "assistant", "content": "It returned 42."},
    ]
    try:
        text = render(tokenizer, turns, generation_prompt=False)
    except Exception as e:  # noqa: BLE001 (jinja raises what the template's author chose)
        return f"the chat template raises on a tool call ({type(e).__name__}: {e})"
    if PROBE_NAME not in text or "42" not in text:
        return "the chat template leaves tool calls or their results out of its render"
    return None


def require_renderable(tokenizer, where: str) -> None:
    reason = template_drops_calls(tokenizer)
    if reason:
        raise UserError(f"{where}: {reason}")
