#!/usr/bin/env bash
# The workflow's stages through the `dflash` CLI, in order, for a machine without Snakemake (a
# lent GPU box): each stage is skipped when its output exists, so rerunning the same command
# resumes (regeneration per batch, training per checkpoint). Single process: the config's
# topology must be colocated with one drafter. The rules in workflow/rules/ are the reference.
#   bash tools/gpu-box/stages.sh config/h200.yaml results [stage ...]
# Stages: target expand regenerate tokenize stats train eval ddtree sampling vllm (default: all
# of them but sampling, at eval.sampling's temperatures, and vllm, which needs vLLM installed).
# $SPLITS: the splits to regenerate and tokenize (default: train eval; `eval` alone for a drafter
# trained elsewhere, placed in results/drafter).
set -euo pipefail
CFG=$1
R=$2
shift 2
STAGES=${*:-target expand regenerate tokenize stats train eval ddtree}
SPLITS=${SPLITS:-train eval}
DFLASH="python3 -m dflash"
mkdir -p "$R/logs"

run() { # stage, output, command...
  local stage=$1 out=$2
  shift 2
  [[ " $STAGES " == *" $stage "* ]] || return 0
  if [ -e "$out" ]; then echo "$stage: $out exists"; return 0; fi
  echo "$stage: start $(date +%T)"
  local t0=$SECONDS
  "$@" >> "$R/logs/$stage.log" 2>&1 || { echo "$stage: FAILED"; tail -20 "$R/logs/$stage.log"; exit 1; }
  echo "$stage: done in $((SECONDS - t0)) s"
}

T=$R/target/hf
run target "$R/target/target.json" $DFLASH target --config "$CFG" --out "$T" --info "$R/target/target.json"
run expand "$R/data/expanded/eval.parquet" $DFLASH expand --config "$CFG" \
  --train "$R/data/expanded/train.parquet" --eval "$R/data/expanded/eval.parquet" \
  --report "$R/data/expanded/report.json"
for split in $SPLITS; do
  run regenerate "$R/data/regenerated/$split.parquet" $DFLASH regenerate --config "$CFG" \
    --target "$T" --input "$R/data/expanded/$split.parquet" \
    --output "$R/data/regenerated/$split.parquet" --workdir "$R/work/regenerate/$split"
  run tokenize "$R/data/tokenized/$split.parquet" $DFLASH tokenize --config "$CFG" --target "$T" \
    --input "$R/data/regenerated/$split.parquet" --output "$R/data/tokenized/$split.parquet"
done
run stats "$R/data/stats/stats.json" $DFLASH stats --config "$CFG" \
  --input "$R/data/tokenized/train.parquet" --json "$R/data/stats/stats.json" \
  --plot "$R/data/stats/stats.png"
run train "$R/train/summary.json" $DFLASH train --config "$CFG" --target "$T" \
  --data "$R/data/tokenized/train.parquet" --out "$R/drafter" --metrics "$R/train/metrics.jsonl" \
  --summary "$R/train/summary.json" --checkpoints "$R/checkpoints" \
  --held-out "$R/data/tokenized/eval.parquet"
EVAL=(--config "$CFG" --target "$T" --drafter "$R/drafter" --held-out "$R/data/expanded/eval.parquet")
run eval "$R/eval/acceptance.json" $DFLASH eval "${EVAL[@]}" \
  --tokenized "$R/data/tokenized/eval.parquet" --train "$R/data/expanded/train.parquet" \
  --output "$R/eval/acceptance.json"
run ddtree "$R/eval/ddtree.json" $DFLASH ddtree "${EVAL[@]}" --output "$R/eval/ddtree.json"
run sampling "$R/eval/sampling.json" $DFLASH sample-eval "${EVAL[@]}" \
  --tokenized "$R/data/tokenized/eval.parquet" --acceptance "$R/eval/acceptance.json" \
  --output "$R/eval/sampling.json"
SAMPLED=()  # vLLM at temperature is set beside our figures there, when they were made
[ -e "$R/eval/sampling.json" ] && SAMPLED=(--sampling "$R/eval/sampling.json")
run vllm "$R/eval/vllm.json" $DFLASH eval-vllm "${EVAL[@]}" --acceptance "$R/eval/acceptance.json" \
  "${SAMPLED[@]}" --output "$R/eval/vllm.json"
