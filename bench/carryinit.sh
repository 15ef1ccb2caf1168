#!/usr/bin/env bash
# A drafter that `bench/h200.sh wait` brought back from a finished run (DIR/drafter-config.json
# and DIR/drafter.safetensors.part-*, under the device tool's files_at), made an exported
# drafter's folder under .carryinit/ (outside git: keep DIR) for drafter.init
# (bench/h200-init.yaml) or `DRAFTER=... bash bench/h200.sh stages`.
#   bash bench/carryinit.sh /work/.device/14            # -> .carryinit/drafter-domains
#   bash bench/carryinit.sh /work/.device/14 NAME       # -> .carryinit/NAME
set -euo pipefail
cd "$(dirname "$0")/.."
src=$1
dest=.carryinit/${2:-drafter-domains}
grep -qx '/.carry\*/' .git/info/exclude 2>/dev/null || echo '/.carry*/' >> .git/info/exclude
mkdir -p "$dest"
cat "$src"/drafter.safetensors.part-* > "$dest/model.safetensors.tmp"
mv "$dest/model.safetensors.tmp" "$dest/model.safetensors"
cp "$src/drafter-config.json" "$dest/config.json"
echo "$dest: $(sha256sum < "$dest/model.safetensors" | cut -c1-16)... $(du -sh "$dest" | cut -f1)"
