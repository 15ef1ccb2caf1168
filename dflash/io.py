"""Atomic file writes and hashing: no reader ever sees a half-written artefact."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; rename it into place only if the block succeeds.

    The temporary lives in the same directory so the rename is atomic on POSIX. On failure it
    is removed and an existing `final` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    if is_dir:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, (0o777 if is_dir else 0o666) & ~_umask())
        if is_dir and final.exists():
            # A directory cannot replace a non-empty one: move the old one aside first, so a
            # crash between the renames leaves it recoverable rather than deleted.
            aside = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def dumps_json(obj) -> str:
    """Canonical JSON (sorted keys, fixed indent) so equal content gives equal bytes."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, dumps_json(obj))


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# The empty file by which Snakemake dates a directory() output: bookkeeping, not content.
SNAKEMAKE_MARKER = ".snakemake_timestamp"


def sha256_tree(path: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file under a directory (or of the file itself), keyed by relative path."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {
        p.relative_to(path).as_posix(): sha256_file(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != SNAKEMAKE_MARKER
    }


def sha256_json(obj) -> str:
    return hashlib.sha256(dumps_json(obj).encode()).hexdigest()
