"""`dflash verify`: re-hash every artefact against the run record. Snakemake never re-checks
outputs after a job, so this is the guard against silent corruption (a flipped bit, a partial
copy, a file edited by hand)."""

from __future__ import annotations

from pathlib import Path

from dflash.errors import UserError
from dflash.io import SNAKEMAKE_MARKER, read_json, sha256_file
from dflash.record import UNDECLARED


def manifest_path(run: str | Path) -> Path:
    """A run is its MANIFEST.json or the results folder that holds it."""
    path = Path(run)
    return path / "MANIFEST.json" if path.is_dir() else path


def check(manifest: Path) -> dict[str, list[str]]:
    """Relative paths that are missing, changed, or present but not recorded."""
    record = read_json(manifest)
    results = manifest.parent
    recorded = record["artefacts"]
    missing, changed = [], []
    for rel, digest in recorded.items():
        path = results / rel
        if not path.is_file():
            missing.append(rel)
        elif sha256_file(path) != digest:
            changed.append(rel)
    extra = [
        rel
        for p in sorted(results.rglob("*"))
        if p.is_file()
        and p.name != SNAKEMAKE_MARKER
        and (rel := p.relative_to(results).as_posix()) not in recorded
        and rel.split("/")[0] not in UNDECLARED
    ]
    return {"missing": missing, "changed": changed, "extra": extra}


def run(args) -> None:
    manifest = manifest_path(args.run)
    if not manifest.is_file():
        raise UserError(f"verify: {manifest} not found (run `snakemake --cores all all` first)")
    found = check(manifest)
    n = len(read_json(manifest)["artefacts"])
    for kind, paths in found.items():
        for rel in paths:
            print(f"{kind:8} {manifest.parent / rel}")
    bad = {kind: len(paths) for kind, paths in found.items() if paths}
    if bad:
        counts = ", ".join(f"{v} {k}" for k, v in bad.items())
        raise UserError(f"{manifest}: {counts} of {n} recorded artefacts")
    print(f"{manifest}: all {n} artefacts match their recorded sha256, no unrecorded files")
