#!/usr/bin/env bash
# A finished run's tokenized training split (brought back from the GPU box: `cp
# results/data/tokenized/train.parquet $OUT/` after the run, its report.json from `wait`'s
# results.tgz) made the folder `bench/h200.sh unpack` takes: .carrydata/data.tar.part-* (outside
# git). A later run then trains on exactly the same rows without regenerating them (4 to 5
# device-minutes saved; the A/B of a training change sees no regeneration variance):
#   bash bench/carrydata.sh /work/.device/7/train.parquet /tmp/r/data/tokenized/train.report.json
#   # on the box: bash bench/h200.sh unpack .carrydata && SPLITS=eval bash bench/h200.sh stages ...
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.carry\*/' .git/info/exclude 2>/dev/null || echo '/.carry*/' >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/data/tokenized"
cp "$1" "$tmp/data/tokenized/train.parquet"
cp "$2" "$tmp/data/tokenized/train.report.json"
rm -rf .carrydata && mkdir .carrydata
tar cf - -C "$tmp" data | split -b 60000000 - .carrydata/data.tar.part-
echo ".carrydata: train.parquet $(sha256sum < "$1" | cut -c1-16)... $(du -sh .carrydata | cut -f1)"
