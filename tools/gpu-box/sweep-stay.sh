#!/usr/bin/env bash
# On the box, after `install`, `stage .carry2c` and `stage .carry3c`, one call carrying .carry4c:
# issue 57's side-by-side trainings (bench/sweep.py) from the recipe's rows made once. It stages
# .carry4c, makes the rows (target expand regenerate tokenize, about 6 minutes on an H100), then
# starts the variants; `wait` brings back each one's metrics, summary and acceptance.json.
# Called again while the rows are still being made, it waits for them again (nothing restarts).
#   bash tools/gpu-box/sweep-stay.sh levers     # AdamW, D-PACE, Muon; a quarter and a half of the rows
#   bash tools/gpu-box/sweep-stay.sh finetune   # from random; a chat drafter and two fine-tunes of it
set -euo pipefail
cd "$(dirname "$0")/../.."
E2=train.epochs=2
case ${1:-} in
levers)
  VARIANTS=(--variant adamw $E2 --variant dpace $E2 drafter.loss=dpace
    --variant muon $E2 train.optimizer=muon
    --variant quarter $E2 data.train_fraction=0.25 --variant half $E2 data.train_fraction=0.5) ;;
finetune)
  TUNE=(drafter.init=sweep:chat train.epochs=1 train.finetune.lr=2e-4 train.finetune.warmup_steps=50)
  VARIANTS=(--variant random $E2 --variant chat $E2 "data.domain_rows={chat: 6000, code: 0, math: 0}"
    --variant ft "${TUNE[@]}" --variant ft-frozen2 "${TUNE[@]}" train.finetune.freeze_layers=2) ;;
*) echo "usage: bash tools/gpu-box/sweep-stay.sh levers|finetune" >&2; exit 2 ;;
esac
R=/tmp/dflash-results
if [ ! -e $R/data/tokenized/eval.parquet ] && ! pgrep -f "gpu-box/stages[.]sh" > /dev/null; then
  [ -d .carry4c ] && bash tools/gpu-box/h200.sh stage .carry4c | tail -2
  bash tools/gpu-box/h200.sh stages config/h200.yaml,config/h200-domains.yaml,tools/gpu-box/h200-no-vllm.yaml \
    target expand regenerate tokenize
fi
deadline=$((SECONDS + 540))  # within the call's 10 minutes
while [ ! -e $R/data/tokenized/eval.parquet ] && pgrep -f "gpu-box/stages[.]sh" > /dev/null &&
  [ $SECONDS -lt $deadline ]; do
  sleep 5
done
grep -E "^[a-z]+: (start|done|FAILED)" /tmp/dflash-run/snakemake.log | tail -8
if [ ! -e $R/data/tokenized/eval.parquet ]; then
  pgrep -f "gpu-box/stages[.]sh" > /dev/null && echo "the rows are still being made: run this again"
  exit 1
fi
if [ -d $R/sweep ]; then echo "the sweep was started before: \`wait\` for it" >&2; exit 1; fi
cd /tmp/dflash-src
PYTHONPATH=/tmp/site:$PWD python3 bench/sweep.py start --config /tmp/dflash-run/config.yaml \
  --results $R --stages train eval "${VARIANTS[@]}"
