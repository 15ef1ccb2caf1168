"""sha256 of the user's own input files (a target directory, data sources, eval sets) by content,
for the rule params that decide reruns, without rehashing gigabytes on every DAG build.

Each file's digest is cached in one small JSON file, keyed by its absolute path, size, mtime_ns,
ctime_ns and inode: an unchanged file costs a stat; a file rewritten, replaced or copied over
has another key and is hashed again, even by `cp -p` (which sets the old date back, but not the
ctime: no tool can). File sizes alone, the former fingerprint of a target directory, missed
same-shape replacement weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.io import sha256_file, write_json

CACHE_FILE = "sha256-cache.json"


class HashCache:
    """The cache file `CACHE_FILE` in `folder` (the config's cache_dir)."""

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / CACHE_FILE
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):  # no cache yet, or a damaged one: hash again
            self.entries = {}
        self.changed = False

    def sha256(self, file: str | os.PathLike) -> str:
        """The file's sha256, from the cache while its path, size, times and inode match."""
        file = os.path.abspath(file)
        st = os.stat(file)
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = self.entries.get(file)
        if entry is None or entry[:-1] != key:
            entry = self.entries[file] = [*key, sha256_file(file)]
            self.changed = True
        return entry[-1]

    def tree(self, folder: str | os.PathLike) -> dict[str, str]:
        """sha256 of every file under `folder` by relative path; hidden files and folders
        (a download's `.cache/`, Snakemake's markers) are bookkeeping, not content."""
        folder = Path(folder)
        return {
            p.relative_to(folder).as_posix(): self.sha256(p)
            for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        }

    def save(self) -> None:
        """Write the cache if it learnt something; a cache that cannot be written (a read-only
        home) only costs hashing again next time."""
        if self.changed:
            try:
                write_json(self.path, self.entries)
            except OSError:
                pass
            self.changed = False
