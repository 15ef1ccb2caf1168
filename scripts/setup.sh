#!/usr/bin/env bash
# Create .venv with the project and its test tools. torch is pinned first: 2.13.0 is the CPU wheel
# these machines carry; asking pip for plain `torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${DFLASH_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
