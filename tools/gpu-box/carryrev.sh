#!/usr/bin/env bash
# Here: the package, benchmarks and configs as they were at commit REV, as the ignored folder
# .carryrev/ (default) to carry beside the working tree, so that one stay on the box times the
# same benchmark at two commits (e.g. bench/step_modes.py before and after a change):
#   bash tools/gpu-box/carryrev.sh bf2e8ba
#   on the box: (cd .carryrev && PYTHONPATH=/tmp/site:$PWD python3 bench/step_modes.py ...)
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$1 dest=${2:-.carryrev}
rm -rf "$dest" && mkdir -p "$dest"
git archive "$rev" dflash bench config workflow/schemas | tar x -C "$dest"
echo "$rev" > "$dest/REV"
echo "$dest: $(git rev-parse --short "$rev"), $(du -sh "$dest" | cut -f1)"
