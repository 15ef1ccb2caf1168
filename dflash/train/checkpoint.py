"""Resumable checkpoints: atomic, sha256-verified, the last K kept, corrupt ones skipped.

Layout: `<run folder>/step-00001200/{state.pt, meta.json, SHA256SUMS}` (the training loop names
run folders by their contract, see `dflash.train.runs.run_folder`). A checkpoint is written into a
temporary sibling folder and renamed into place, so a crash mid-write never leaves a folder that
looks complete. `meta.json` carries a resume contract (model shape, block size, gamma, anchors,
data sha256, topology...): resuming under a different contract is refused with the keys that
differ, rather than silently training a different run.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import torch

from dflash.errors import UserError
from dflash.io import atomic_path, read_json, sha256_file, write_json

log = logging.getLogger(__name__)
PATTERN = re.compile(r"^step-(\d{8})$")
SUMS = "SHA256SUMS"


class ContractError(UserError):
    pass


def _folders(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders, newest first (temporary folders never match)."""
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        m = PATTERN.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def save_checkpoint(root: str | Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    root = Path(root)
    final = root / f"step-{step:08d}"
    started = time.perf_counter()
    with atomic_path(final, is_dir=True) as tmp:
        torch.save(state, tmp / "state.pt")
        written = time.perf_counter()
        write_json(tmp / "meta.json", {**meta, "step": step})
        sums = {name: sha256_file(tmp / name) for name in ("state.pt", "meta.json")}
        (tmp / SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    hashed = time.perf_counter()
    for _, old in _folders(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    # at 8B shapes a checkpoint is ~12 GB (fp32 weights and AdamW moments): say what it cost
    log.info(
        "checkpoint %s: %.2f GB in %.1f s (write %.1f, sha256 %.1f)",
        final.name,
        (final / "state.pt").stat().st_size / 1e9,
        hashed - started,
        written - started,
        hashed - written,
    )
    return final


def verify(folder: Path) -> str | None:
    """None if every file matches SHA256SUMS, else the reason it does not."""
    sums = folder / SUMS
    if not sums.exists():
        return f"{SUMS} missing"
    for line in sums.read_text().splitlines():
        digest, name = line.split("  ", 1)
        path = folder / name
        if not path.exists():
            return f"{name} missing"
        if sha256_file(path) != digest:
            return f"{name} sha256 mismatch"
    return None


def latest_valid(root: str | Path) -> tuple[Path, dict] | None:
    """The newest checkpoint whose files verify; corrupt newer ones are reported and skipped."""
    for _, folder in _folders(Path(root)):
        problem = verify(folder)
        if problem is None:
            return folder, read_json(folder / "meta.json")
        log.warning("checkpoint %s is corrupt (%s); trying an older one", folder, problem)
    return None


def load_state(folder: Path, map_location="cpu") -> dict:
    return torch.load(folder / "state.pt", map_location=map_location, weights_only=False)


def contract_diff(saved: dict, current: dict) -> list[str]:
    return [
        f"  {k}: checkpoint {saved.get(k)!r} != now {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]


def check_contract(saved: dict, current: dict, where: Path) -> None:
    """Refuse to resume if anything the run's meaning depends on changed (a run's folder is named
    by its contract, so this catches a folder edited or copied by hand)."""
    if lines := contract_diff(saved, current):
        raise ContractError(
            f"cannot resume from {where}: the run changed\n" + "\n".join(lines) + "\n"
            "move the checkpoint folder away to start afresh"
        )
