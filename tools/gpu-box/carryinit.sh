#!/usr/bin/env bash
# A drafter that `tools/gpu-box/h200.sh wait` brought back from a finished run (DIR/drafter-config.json
# and DIR/drafter.safetensors.part-*, under the device tool's files_at), made an exported
# drafter's folder under .carryinit/ (outside git: keep DIR) for drafter.init
# (tools/gpu-box/h200-init.yaml) or `DRAFTER=... bash tools/gpu-box/h200.sh stages`.
#   bash tools/gpu-box/carryinit.sh FILES_AT            # -> .carryinit/drafter-domains
#   bash tools/gpu-box/carryinit.sh FILES_AT NAME       # -> .carryinit/NAME
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$1
dest=.carryinit/${2:-drafter-domains}
mkdir -p "$dest"
cat "$src"/drafter.safetensors.part-* > "$dest/model.safetensors.tmp"
mv "$dest/model.safetensors.tmp" "$dest/model.safetensors"
cp "$src/drafter-config.json" "$dest/config.json"
echo "$dest: $(sha256sum < "$dest/model.safetensors" | cut -c1-16)... $(du -sh "$dest" | cut -f1)"
