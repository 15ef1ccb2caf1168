"""Resumable checkpoints: atomic, sha256-verified, the last K kept, corrupt ones skipped.

Layout: `<run folder>/step-00001200/{state.pt, meta.json, SHA256SUMS}` (the training loop names
run folders by their contract, see `dflash.train.runs.run_folder`). A checkpoint is written into a
temporary sibling folder and renamed into place, so a crash mid-write never leaves a folder that
looks complete. `meta.json` carries a resume contract (model shape, block size, gamma, anchors,
data sha256, topology...): resuming under a different contract is refused with the keys that
differ, rather than silently training a different run.

`state.pt` holds only tensors and plain containers (numbers, strings, lists, dicts, tuples), so it
loads with `torch.load(weights_only=True)`: a matching SHA256SUMS proves the file is the one
written beside it, not that its writer was this code, and a full unpickle could run any code.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import re
import shutil
import threading
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dflash.errors import UserError
from dflash.io import atomic_path, read_json, sha256_file, write_json

log = logging.getLogger(__name__)
PATTERN = re.compile(r"^step-(\d{8})$")
SUMS = "SHA256SUMS"


class ContractError(UserError):
    pass


class UnsafeCheckpointError(UserError):
    pass


def _folders(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders, newest first (temporary folders never match)."""
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        m = PATTERN.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


class _HashingFile:
    """A file opened for writing that hashes the bytes on their way: a 12 GB checkpoint is not
    read back to be hashed (11 s of a 30 s checkpoint at 8B shapes on an H200)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(root: str | Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    root = Path(root)
    final = root / f"step-{step:08d}"
    started = time.perf_counter()
    with atomic_path(final, is_dir=True) as tmp:
        with open(tmp / "state.pt", "wb") as f:
            out = _HashingFile(f)
            torch.save(state, out)
        write_json(tmp / "meta.json", {**meta, "step": step})
        sums = {"state.pt": out.sha.hexdigest(), "meta.json": sha256_file(tmp / "meta.json")}
        (tmp / SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    for _, old in _folders(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    # at 8B shapes a checkpoint is ~12.6 GB (fp32 weights and AdamW moments): say what it cost
    log.info(
        "checkpoint %s: %.2f GB written and hashed in %.1f s",
        final.name,
        (final / "state.pt").stat().st_size / 1e9,
        time.perf_counter() - started,
    )
    return final


class HostSnapshots:
    """Copies of a training state in host memory for a checkpoint. CUDA tensors go into
    page-locked buffers made at the first copy and reused by the next ones, so the copy runs at
    the link's speed: 12.55 GB took 7.2 s into pageable memory on an H200, 4.2 s the first
    time into page-locked buffers and 0.23 s every later time (bench/checkpoint_copy.py). A copy overwrites the previous one: its write must be done first."""

    def __init__(self):
        self._buffers: dict[int, torch.Tensor | None] = {}

    def copy(self, state):
        leaves, spec = tree_flatten(state)
        copied, on_gpu = [], False
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                buffer = self._buffers.get(i)
                if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype:
                    buffer = self._buffers[i] = self._page_locked(x)
                if buffer is None:  # no page-locked memory to be had: the slow copy
                    copied.append(x.detach().to("cpu", copy=True))
                    continue
                buffer.copy_(x.detach(), non_blocking=True)
                copied.append(buffer)
                on_gpu = True
            elif isinstance(x, torch.Tensor):
                copied.append(x.detach().to("cpu", copy=True))
            else:
                copied.append(x)
        if on_gpu:
            torch.cuda.synchronize()  # the copies are asynchronous: done before the step goes on
        return tree_unflatten(copied, spec)

    @staticmethod
    def _page_locked(like: torch.Tensor) -> torch.Tensor | None:
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError as e:  # the host cannot lock that much: copy as before, say so
            log.warning("checkpoint: no page-locked host memory (%s); copying to pageable", e)
            return None


class BackgroundCheckpoints:
    """Checkpoints written by a thread while training goes on: the step pays only for a copy of
    the state into host memory. At 8B shapes a checkpoint (12.6 GB) took 29-35 s to write and
    hash on an H200, three of them 26 % of a 348 s training stage. One write at a time: the next
    checkpoint, and the end of training, wait for the one in flight; a write that failed raises
    there."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host = HostSnapshots()

    def save(self, root: Path, step: int, state: dict, meta: dict, keep: int) -> None:
        self.wait()  # before the host buffers are overwritten
        started = time.perf_counter()
        snapshot = self._host.copy(state)
        log.info(
            "checkpoint step %d: state copied to host in %.1f s",
            step,
            time.perf_counter() - started,
        )

        def write():
            try:
                save_checkpoint(root, step, snapshot, meta, keep)
            except BaseException as e:  # noqa: BLE001  (raised in the training thread)
                self._error = e

        self._thread = threading.Thread(target=write, name=f"checkpoint-{step}")
        self._thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Until the write in flight is done; its failure raised here (unless `raise_error` is
        off: training already failed, and that error is the one to report)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error


def verify(folder: Path) -> str | None:
    """None if every file matches SHA256SUMS, else the reason it does not."""
    sums = folder / SUMS
    if not sums.exists():
        return f"{SUMS} missing"
    listed = {}
    for number, line in enumerate(sums.read_text(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            return f"{SUMS} line {number} is malformed"
        listed[name] = digest
    # a damaged (e.g. emptied) list must not vouch for files it no longer names
    for name in ("state.pt", "meta.json"):
        if name not in listed:
            return f"{SUMS} does not list {name}"
    for name, digest in listed.items():
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
    """The training state of a checkpoint, refusing anything but tensors and plain containers."""
    path = Path(folder) / "state.pt"
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise UnsafeCheckpointError(
            f"cannot resume from {path}: besides tensors it holds a pickled "
            f"{found.group(1) if found else 'object'}, which was not loaded because unpickling "
            "it could run arbitrary code. The trainer writes only tensors, numbers, strings, "
            "lists and dicts there, so this file did not come from it. Move "
            f"{folder} away to resume from the previous checkpoint (or start afresh)"
        ) from None


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
