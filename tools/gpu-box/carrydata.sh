#!/usr/bin/env bash
# A finished run's tokenized training split (brought back from the GPU box: `cp
# results/data/tokenized/train.parquet $OUT/` after the run, its report.json from `wait`'s
# results.tgz) made the folder `tools/gpu-box/h200.sh unpack` takes: .carrydata/data.tar.part-* (outside
# git). A later run then trains on exactly the same rows without regenerating them (4 to 5
# device-minutes saved; the A/B of a training change sees no regeneration variance):
#   bash tools/gpu-box/carrydata.sh FILES_AT/train.parquet RUN/data/tokenized/train.report.json
#   # on the box: bash tools/gpu-box/h200.sh unpack .carrydata && SPLITS=eval bash tools/gpu-box/h200.sh stages ...
# With $SOURCE and $EXPANDED (the run's results/data/expanded/train.parquet) only the rows of that
# source are kept, into $DIR (default .carrydata); tools/gpu-box/h200-init-chat.sh's chat drafter:
#   SOURCE=sharegpt EXPANDED=RUN/data/expanded/train.parquet DIR=.carrysg bash tools/gpu-box/carrydata.sh ...
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/data/tokenized"
DIR=${DIR:-.carrydata}
case $DIR in .carry*) ;; *) echo "DIR must be a .carry* folder (git ignores those): $DIR" >&2 && exit 2 ;; esac
out=$tmp/data/tokenized/train.parquet
if [ -n "${SOURCE:-}" ]; then
  "${PYTHON:-.venv/bin/python}" tools/gpu-box/carry_source.py "$1" "$2" \
    "${EXPANDED:?EXPANDED: the run results/data/expanded/train.parquet}" "$SOURCE" "$out"
else
  cp "$1" "$out"
  cp "$2" "$tmp/data/tokenized/train.report.json"
fi
rm -rf "$DIR" && mkdir "$DIR"
tar cf - -C "$tmp" data | split -b 60000000 - "$DIR/data.tar.part-"
echo "$DIR: train.parquet $(sha256sum < "$out" | cut -c1-16)... $(du -sh "$DIR" | cut -f1)"
