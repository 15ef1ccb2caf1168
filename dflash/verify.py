"""`dflash verify`: re-hash every artefact and every recorded input (the converted target under
resources/) against the run record. Snakemake never re-checks outputs after a job, so this is the
guard against silent corruption (a flipped bit, a partial copy, a file edited by hand)."""

from __future__ import annotations

import os
from pathlib import Path

from dflash.errors import UserError
from dflash.io import SNAKEMAKE_MARKER, sha256_file
from dflash.record import UNDECLARED, read_record


def manifest_path(run: str | Path) -> Path:
    """A run is its MANIFEST.json or the results folder that holds it."""
    path = Path(run)
    return path / "MANIFEST.json" if path.is_dir() else path


def unrecorded(folder: Path, recorded: dict, skip=()) -> list[str]:
    return [
        rel
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name != SNAKEMAKE_MARKER
        and (rel := p.relative_to(folder).as_posix()) not in recorded
        and rel.split("/")[0] not in skip
    ]


def check(manifest: Path, record: dict) -> dict[str, list[str]]:
    """Paths relative to the results folder that are missing, changed, or present but not
    recorded: the artefacts under it, and each input's files (a path into resources/)."""
    results = manifest.parent
    trees = [("", results, record["artefacts"], UNDECLARED)]
    for entry in (record.get("inputs") or {}).values():
        trees.append((entry["path"] + "/", results / entry["path"], entry["sha256"], ()))
    missing, changed, extra = [], [], []
    for prefix, folder, recorded, skip in trees:
        for rel, digest in recorded.items():
            path = folder / rel
            if not path.is_file():
                missing.append(prefix + rel)
            elif sha256_file(path) != digest:
                changed.append(prefix + rel)
        if folder.is_dir():
            extra += [prefix + rel for rel in unrecorded(folder, recorded, skip)]
    return {"missing": missing, "changed": changed, "extra": extra}


def recorded_count(record: dict) -> int:
    inputs = record.get("inputs") or {}
    return len(record["artefacts"]) + sum(len(e["sha256"]) for e in inputs.values())


def run(args) -> None:
    manifest = manifest_path(args.run)
    if not manifest.is_file():
        raise UserError(f"verify: {manifest} not found (run `snakemake --cores all all` first)")
    record = read_record(manifest, "verify")
    found = check(manifest, record)
    n = recorded_count(record)
    for kind, paths in found.items():
        for rel in paths:
            print(f"{kind:8} {os.path.normpath(manifest.parent / rel)}")
    bad = {kind: len(paths) for kind, paths in found.items() if paths}
    if bad:
        counts = ", ".join(f"{v} {k}" for k, v in bad.items())
        raise UserError(f"{manifest}: {counts} of {n} recorded files (artefacts and inputs)")
    print(
        f"{manifest}: all {n} artefacts and inputs match their recorded sha256, no unrecorded files"
    )
