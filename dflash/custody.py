"""Chain of custody: an artefact is read only while it holds the bytes its producer wrote.

Every stage records the sha256 of its outputs in its manifest (dflash.manifest), and Snakemake
never looks at an output again once its job has ended. So three places compare a file with the
record of the stage that wrote it:
- planning (the Snakefile, `damaged`): a declared output that differs is moved aside and
  every target rule asks for it (`pending`), so Snakemake reruns its rule and what follows;
- every stage, before any work (`check_inputs`, called by the CLI on the inputs a stage
  declares): a file changed after planning or given by hand stops the stage, naming it;
- `record`: the run record must agree with every stage's own (dflash.record).

Cost: files under the results folder (parquet, drafter, JSON) are hashed in full at every check
(planning hashes them in parallel threads): each is read by a few jobs that take far longer than
hashing it (~1 GB/s a core), and a change that keeps size and mtime (a bit flipped below the
filesystem, a copy with `cp -p`) is exactly what must not be missed there. A file outside it (the converted target under resources/:
16 GB at 8B, read by every job of every run) goes through the hash cache (dflash.filehash):
hashed in full once, then trusted while its size, mtime, ctime and inode are unchanged (ctime
cannot be set back by hand, so a rewrite, truncation, `cp -p` or replacement is hashed again);
`dflash verify` re-hashes it in full.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash.config import expand_user
from dflash.errors import UserError
from dflash.filehash import HashCache
from dflash.io import read_json, sha256_file

# Where damaged outputs are moved: an undeclared folder (dflash.record.UNDECLARED).
QUARANTINE = "work/damaged"
# The hash cache's folder when a stage is given no config (the schema's cache_dir default).
DEFAULT_CACHE_DIR = "~/.cache/dflash"


@dataclass(frozen=True)
class Mismatch:
    path: Path  # absolute
    recorded: str
    actual: str | None  # None: missing
    manifest: Path

    def __str__(self) -> str:
        now = f"now {self.actual}" if self.actual else "it is missing now"
        return f"{rel(self.path)} (recorded sha256 {self.recorded} in {rel(self.manifest)}, {now})"


def rel(path: Path) -> str:
    """A path as the user typed it: relative to the working directory when under it."""
    with contextlib.suppress(ValueError):
        return Path(path).relative_to(Path.cwd()).as_posix()
    return str(path)


def read_stage_manifest(path: Path) -> dict:
    """A stage manifest, or UserError naming it if it is not one (cut short, edited)."""
    try:
        manifest = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a stage manifest: it is not valid JSON ({e})") from None
    keys = ("stage", "outputs", "output_sha256")
    if not isinstance(manifest, dict) or any(not manifest.get(k) for k in keys):
        raise UserError(f"{path} is not a stage manifest: it lacks one of {', '.join(keys)}")
    outputs, hashes = manifest["outputs"], manifest["output_sha256"]
    if not (
        isinstance(outputs, dict)
        and isinstance(hashes, dict)
        and all(isinstance(outputs.get(k), str) and isinstance(v, dict) for k, v in hashes.items())
    ):
        raise UserError(f"{path} is not a stage manifest: its outputs and their sha256 disagree")
    return manifest


def recorded_files(path: Path, manifest: dict) -> dict[Path, str]:
    """Absolute path -> sha256 of every file the stage wrote. Outputs are recorded as given on
    the command line (relative to the working directory), each as a tree keyed by the path
    relative to the output, or by its name for a single file."""
    files = {}
    for name, out in manifest["outputs"].items():
        base = Path(out).resolve()
        tree = manifest["output_sha256"].get(name, {})
        single = set(tree) == {base.name} and not base.is_dir()
        for key, digest in tree.items():
            files[base if single else base / key] = digest
    return files


class Hasher:
    """sha256 of a file (None if missing): in full under the results folder, else through the
    hash cache (see the module doc)."""

    def __init__(self, results: Path | None, cache: HashCache):
        self.results = results.resolve() if results else None
        self.cache = cache

    def __call__(self, path: Path) -> str | None:
        if not path.is_file():
            return None
        if self.results is not None and path.is_relative_to(self.results):
            return sha256_file(path)
        return self.cache.sha256(path)


def compare(recorded: Mapping[Path, tuple[str, Path]], hasher: Hasher) -> list[Mismatch]:
    """Hash the files (in parallel threads: hashlib releases the GIL) against their record."""
    paths = sorted(recorded)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        actual = list(pool.map(hasher, paths))
    hasher.cache.save()
    return [
        Mismatch(p, recorded[p][0], a, recorded[p][1])
        for p, a in zip(paths, actual, strict=True)
        if a != recorded[p][0]
    ]


def producers(manifests: Iterable[Path]) -> tuple[dict[Path, tuple[str, Path]], list[Path]]:
    """File -> (sha256, manifest) over the stage manifests that exist, and those that cannot
    be read."""
    found, unreadable = {}, []
    for path in map(Path, manifests):
        if not path.is_file():
            continue
        try:
            files = recorded_files(path, read_stage_manifest(path))
        except UserError:
            unreadable.append(path.resolve())
            continue
        found |= {f: (digest, path.resolve()) for f, digest in files.items()}
    return found, unreadable


def _paths(value) -> list[Path]:
    if value is None:
        return []
    return [Path(v) for v in value] if isinstance(value, list | tuple) else [Path(value)]


def results_folder(paths: Iterable[Path]) -> Path | None:
    """The nearest folder above one of the paths that holds a manifests/ folder."""
    for path in paths:
        for folder in path.parents:
            if (folder / "manifests").is_dir():
                return folder
    return None


def check_inputs(
    inputs: Mapping[str, object], manifest: Path | None = None, cache_dir: str | None = None
) -> None:
    """Refuse (UserError) if a file the stage is about to read differs from its producer's
    record. The producers' manifests are those of the results folder the inputs are in (its
    manifests/) and a `manifest.json` beside an input (the converted target's folder). A file
    no stage recorded (a user's own data or target) is not checked, nor one whose producer's
    manifest cannot be read (planning reruns that producer). `manifest` is the stage's own (it
    names the results folder when no input is in one); `cache_dir` the config's (the hash
    cache's folder)."""
    reads = [p.resolve() for value in inputs.values() for p in _paths(value)]
    own = [Path(manifest).resolve()] if manifest is not None else []
    results = results_folder(own + reads)
    candidates = {p.parent / "manifest.json" for p in reads}
    if results is not None:
        candidates |= set((results / "manifests").glob("*.json"))
    found, _ = producers(sorted(candidates))
    recorded = {
        f: rec for f, rec in found.items() if any(f == p or f.is_relative_to(p) for p in reads)
    }
    cache = HashCache(expand_user(cache_dir or DEFAULT_CACHE_DIR))
    bad = compare(recorded, Hasher(results, cache))
    if bad:
        raise UserError(
            "an input is not what its producer wrote: "
            + "; ".join(map(str, bad))
            + ". Nothing was run. Rerun the workflow (Snakemake rebuilds a damaged output"
            " before anything reads it) or restore the file."
        )


def damaged(
    manifests: Iterable[Path],
    declared: Iterable[str | os.PathLike],
    results: Path,
    cache: HashCache,
) -> dict[Path, list[str]]:
    """Declared output (a file, or a directory output) -> why it differs from its stage's
    record. Only declared outputs count: a manifest left by another config may name files no
    rule of this one makes. A stage manifest that cannot be read is damaged itself."""
    declared = {Path(d).resolve() for d in declared}
    recorded, unreadable = producers(manifests)
    found = {p: [f"{rel(p)} is not a readable stage manifest"] for p in unreadable if p in declared}
    for mismatch in compare(recorded, Hasher(results, cache)):
        if mismatch.actual is None:
            continue  # a missing output: Snakemake reruns its rule by itself
        owner = next((p for p in (mismatch.path, *mismatch.path.parents) if p in declared), None)
        if owner is not None:
            found.setdefault(owner, []).append(str(mismatch))
    return found


def quarantined(path: Path, results: Path) -> Path:
    """Where `quarantine` keeps a damaged output: results/work/damaged/ (undeclared, so
    `verify` ignores it), at its path under the results folder, else at its path as `rel`
    shows it (the target's folder under resources/, whose every file the run record hashes,
    must not keep it)."""
    results = results.resolve()
    path = path.resolve()
    where = path.relative_to(results) if path.is_relative_to(results) else rel(path).lstrip("/")
    return results / QUARANTINE / where


def quarantine(path: Path, results: Path) -> Path:
    """Move a damaged output aside (kept for a look, never deleted); return where to."""
    dest = quarantined(path, results)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_dir():
        shutil.rmtree(dest)
    shutil.move(path, dest)  # a rename, or a copy where resources/ is another filesystem
    return dest


def pending(declared: Iterable[str], results: Path) -> list[str]:
    """Declared outputs moved aside and not made again yet. The workflow's target rules ask for
    them: Snakemake makes a missing file only when something that must run needs it, and the
    rules after a damaged output are up to date."""
    return [d for d in declared if not os.path.exists(d) and quarantined(Path(d), results).exists()]
