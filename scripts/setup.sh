#!/usr/bin/env bash
# Create .venv with the project and its test tools. torch is pinned first: 2.13.0 is the CPU wheel
# these machines carry; asking pip for plain `torch` would pull a multi-GB CUDA build.
# pip compiles every module here on purpose: where PYTHONDONTWRITEBYTECODE is set (the CI machine
# sets it) nothing else ever writes .pyc files, and with `--no-compile` each process compiled
# transformers from source (setup 70 s faster, CI 4.7 min slower, 2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${DFLASH_TORCH_VERSION:-2.13.0}"
# Before 2026-12-03 this project installed as `dflash`, the name of the DFlash authors' package:
# drop such an install of this folder, so that no old `dflash` command or import hook remains.
.venv/bin/python -I -c 'import importlib.metadata as m, json, os, sys
u = json.loads(m.distribution("dflash").read_text("direct_url.json") or "{}")
sys.exit(u.get("url") != "file://" + os.getcwd())' 2>/dev/null &&
    .venv/bin/python -m pip uninstall -q -y dflash
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# Snakemake names neither the file nor the line of a --configfile that is not valid YAML: every
# Python of this environment wraps its loader so that it does (dflash/yaml_lines.py).
.venv/bin/python -c 'import pathlib, site
line = "import importlib.util as u; u.find_spec(\"dflash\") and __import__(\"dflash.yaml_lines\").yaml_lines.install()\n"
pathlib.Path(site.getsitepackages()[0], "dflash_yaml_lines.pth").write_text(line)'
