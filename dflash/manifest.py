"""Sidecar manifests: what a rule read, with which parameters and code, and what it wrote.

Snakemake never hashes outputs and cannot see imported modules or pip upgrades, so every stage
records sha256 of its outputs, of its inputs, its parameters, and hashes of the package source and
of the installed environment. Manifests hold no timestamps or host names: two identical runs
produce byte-identical manifests.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

from dflash.io import sha256_json, sha256_tree, write_json

PACKAGE_ROOT = Path(__file__).resolve().parent

# Modules every stage imports (io, config, manifests). Not cli.py: it only maps arguments to a
# stage's `run`, rules pass every argument explicitly (a change shows in the rule's shell command,
# a Snakemake code trigger), and adding a subcommand must not rerun every stage.
_SHARED = (
    "__init__.py",
    "__main__.py",
    "config.py",
    "io.py",
    "manifest.py",
    "wheels.py",
    "errors.py",
)


def code_hash(*subpackages: str) -> str:
    """sha256 over the source of the shared modules plus the named subpackages of `dflash`."""
    files = [PACKAGE_ROOT / name for name in _SHARED]
    for sub in subpackages:
        target = PACKAGE_ROOT / sub
        files += sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_versions() -> dict[str, str]:
    """name -> version of every installed distribution (what `pip freeze` would list)."""
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[name.lower().replace("_", "-")] = dist.version
    return dict(sorted(versions.items()))


def environment_hash() -> str:
    return sha256_json(environment_versions())


def describe_paths(paths: Mapping[str, str | os.PathLike]) -> dict[str, dict[str, str]]:
    return {name: sha256_tree(path) for name, path in sorted(paths.items())}


def write_manifest(
    path: str | os.PathLike,
    stage: str,
    inputs: Mapping[str, str | os.PathLike],
    outputs: Mapping[str, str | os.PathLike],
    params: Mapping | None = None,
    code: str | None = None,
) -> dict:
    """Hash inputs and outputs and write the stage's manifest atomically; return it."""
    manifest = {
        "stage": stage,
        "params": dict(params or {}),
        "code_sha256": code,
        "inputs": {name: str(p) for name, p in sorted(inputs.items())},
        "input_sha256": describe_paths(inputs),
        "outputs": {name: str(p) for name, p in sorted(outputs.items())},
        "output_sha256": describe_paths(outputs),
    }
    write_json(path, manifest)
    return manifest
