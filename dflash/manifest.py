"""Sidecar manifests: what a rule read, with which parameters and code, and what it wrote.

Snakemake never hashes outputs and cannot see imported modules or pip upgrades, so every stage
records sha256 of its outputs, of its inputs, its parameters, and hashes of the package source and
of the installed environment. Manifests hold no timestamps or host names: two identical runs
produce byte-identical manifests.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash.io import sha256_file, sha256_json, sha256_tree, write_json

PACKAGE_ROOT = Path(__file__).resolve().parent


@functools.cache
def _module_file(name: str) -> Path | None:
    """The source file of a `dflash` module name, or None if it is not one (cached: the
    workflow resolves the same names for a dozen stages at every Snakemake start)."""
    top, *rest = name.split(".")
    if top != "dflash":
        return None
    if not rest:
        return PACKAGE_ROOT / "__init__.py"
    rel = PACKAGE_ROOT.joinpath(*rest)
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _imports(source: str, filename: str) -> tuple[str, ...]:
    """Module names a source imports (function-level imports included). Cached by content:
    the workflow hashes a dozen stages' code at every Snakemake start, mostly the same files."""
    names = []
    for node in _statements(ast.parse(source, filename).body):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from dflash.x import y`: y may be a submodule or a name in x
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return tuple(names)


def _statements(body: list[ast.stmt]):
    """Every statement under `body`, nested ones included (function bodies, branches, handlers,
    match cases), without visiting expressions: an import is always a statement, and skipping
    the expressions makes this ten times faster than `ast.walk` at every Snakemake start."""
    todo = list(body)
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo += getattr(node, field, None) or []


def imported_files(*modules: str) -> list[Path]:
    """The named modules' source files plus every `dflash` module they import, transitively
    (function-level imports included), plus the package `__init__` files on their paths."""
    seen: set[Path] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            f = _module_file(".".join(parts[:i]))
            if f is None or f in seen:
                continue
            seen.add(f)
            todo += _imports(f.read_text(), str(f))
    return sorted(seen)


def code_files(*modules: str) -> dict[str, str]:
    """sha256 of each source file the named modules run (`imported_files`), keyed by its path
    in the repository ("dflash/train/loop.py"): what `dflash compare` names."""
    return {
        f.relative_to(PACKAGE_ROOT.parent).as_posix(): sha256_file(f)
        for f in imported_files(*modules)
    }


def code_hash(*modules: str) -> str:
    """One sha256 over `code_files`: as a rule param, an edit to any module a stage runs reruns
    that stage and nothing else (`cli.py` only maps arguments; rules pass every one explicitly,
    so a wiring change shows in the shell command instead)."""
    if not modules or not all(_module_file(m) for m in modules):
        raise ValueError(f"code_hash: not dflash modules: {modules}")
    return sha256_json(code_files(*modules))


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


def gpus() -> dict:
    """GPU models and driver from NVML (no CUDA context is created); empty without GPUs."""
    from dflash.host import nvml

    none = {"count": 0, "models": [], "driver": None}
    nv = nvml()
    if nv is None:  # no NVIDIA driver
        return none
    try:
        count = nv.nvmlDeviceGetCount()
        models = [nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        driver = nv.nvmlSystemGetDriverVersion() if models else None
    except nv.NVMLError:
        return none
    finally:
        nv.nvmlShutdown()
    return {"count": len(models), "models": models, "driver": driver}


def environment_record() -> dict:
    """What a run's numbers can depend on outside the code: interpreter, the versions that matter
    most, the accelerator stack, and every installed package."""
    import torch

    packages = environment_versions()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": packages.get("transformers"),
        "snakemake": packages.get("snakemake"),
        "gpus": gpus(),
        "packages": packages,
        "sha256": sha256_json(packages),
    }


def describe_paths(paths: Mapping[str, str | os.PathLike]) -> dict[str, dict[str, str]]:
    return {name: sha256_tree(path) for name, path in sorted(paths.items())}


def write_manifest(
    path: str | os.PathLike,
    stage: str,
    inputs: Mapping[str, str | os.PathLike],
    outputs: Mapping[str, str | os.PathLike],
    params: Mapping | None = None,
    code: Sequence[str] = (),
) -> dict:
    """Hash inputs and outputs and write the stage's manifest atomically; return it.

    `code` names the module the stage runs (as for `code_hash`)."""
    manifest = {
        "stage": stage,
        "params": dict(params or {}),
        "code_sha256": code_hash(*code),
        "code_files": code_files(*code),
        "environment": environment_record(),
        "inputs": {name: str(p) for name, p in sorted(inputs.items())},
        "input_sha256": describe_paths(inputs),
        "outputs": {name: str(p) for name, p in sorted(outputs.items())},
        "output_sha256": describe_paths(outputs),
    }
    write_json(path, manifest)
    return manifest
