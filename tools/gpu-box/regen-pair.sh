#!/usr/bin/env bash
# On the box, after `install` and the three `stage` calls: the regeneration-mode study's two sides
# (issue 55, item 7) side by side on the one GPU. `target` and `expand` once in results/, then
# results/pair/greedy and results/pair/t07 (each its own config, the expanded rows copied, the
# target linked) run tools/gpu-box/stages.sh regenerate ... sampling in the background; `wait`
# then brings back both (its file list holds pair/*/eval/*.json and pair/*/train/summary.json).
#   bash tools/gpu-box/regen-pair.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=config/h200.yaml,config/h200-domains.yaml,tools/gpu-box/h200-no-vllm.yaml,tools/gpu-box/h200-sampling.yaml,tools/gpu-box/h200-regen-pair.yaml,tools/gpu-box/h200-sets-first-12.yaml
bash tools/gpu-box/h200.sh stages "$BASE" target expand
while pgrep -f gpu-box/stages.sh > /dev/null; do sleep 2; done
cd /tmp/dflash-src
export PYTHONPATH=/tmp/site:$PWD
for side in greedy t07; do
  D=results/pair/$side
  mkdir -p "$D/data" "$D/logs"
  ln -sfn "$(readlink -f results/target)" "$D/target"
  cp -r results/data/expanded "$D/data/"
  python3 -c 'import sys, yaml; sys.path.insert(0, "bench"); from sweep import with_overrides
yaml.safe_dump(with_overrides(yaml.safe_load(open(sys.argv[1])), sys.argv[3:]), open(sys.argv[2], "w"))' \
    /tmp/dflash-run/config.yaml "$D/config.yaml" \
    $([ $side = t07 ] && echo data.regenerate.temperature=0.7 data.regenerate.top_p=0.95 ||
      echo data.regenerate.temperature=0.0)
  setsid nohup bash tools/gpu-box/stages.sh "$D/config.yaml" "$D" regenerate tokenize train eval \
    sampling > "$D/logs/stages.log" 2>&1 < /dev/null &
done
sleep 5; tail -n 3 results/pair/*/logs/stages.log
