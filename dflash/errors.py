"""Errors caused by the user's input or configuration: reported as one clear line, no traceback.
A full disk is the user's to fix too, so it is explained the same way (`disk_full`)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class UserError(ValueError):
    pass


def _no_space(exc: BaseException | None) -> bool:
    """Whether a full disk caused `exc`: an ENOSPC OSError anywhere in its chain, or the text
    of one in a library's own exception (polars and pyarrow wrap it: "os error 28")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc) or "os error 28" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _folder(path: Path) -> Path:
    """`path`'s nearest existing folder (an output's folder may not exist yet)."""
    path = Path(os.path.abspath(path))
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full(exc: BaseException, paths: list[Path]) -> UserError | None:
    """A one-paragraph UserError for a stage that ran out of disk space, naming the folder it
    wrote and the free space of each disk among `paths` (the stage's files; the failing file
    first when the error names it), or None if `exc` is not a full disk."""
    if not _no_space(exc):
        return None
    failing = getattr(exc, "filename", None)
    folders, devices = [], set()
    for path in ([Path(failing)] if failing else []) + list(paths):
        folder = _folder(path)
        device = folder.stat().st_dev
        if device not in devices:
            devices.add(device)
            folders.append(f"{folder} ({_size(shutil.disk_usage(folder).free)} free)")
    where = f" writing {failing}" if failing else ""
    return UserError(
        f"no space left on the device{where}: {'; '.join(folders) or 'its disk'}. Free space"
        " there (or point `results`/`resources` at a larger disk) and rerun: outputs are"
        " written atomically, so nothing half-written was left behind; this stage's log may be"
        " empty or cut short when it is on the same disk"
    )
