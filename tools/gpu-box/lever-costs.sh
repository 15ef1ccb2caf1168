#!/usr/bin/env bash
# On the box, one call (carry .whl): what issue 57's levers cost a step, apart from what they do
# to τ. The optimizer's step alone, AdamW and Muon in turn, at an 8B target's drafter and at the
# recipe's (bench/optimizer_step.py); then the recipe's training step per bucket shape with the
# decayed CE and with D-PACE, in the order CE, D-PACE, D-PACE, CE (bench/step_modes.py, each in a
# fresh process). About 7 minutes on an H100; the figures come back under $OUT.
#   bash tools/gpu-box/lever-costs.sh [8b-only]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/gpu-box/h200.sh install
export PYTHONPATH=/tmp/site:$PWD
recipe=config/h200.yaml,config/h200-domains.yaml,tools/gpu-box/h200-no-vllm.yaml
echo "drafter: {loss: dpace}" > /tmp/dpace-only.yaml  # the D-PACE lever overlay's one key
bash tools/gpu-box/h200.sh merge /tmp/ce.yaml $recipe
bash tools/gpu-box/h200.sh merge /tmp/dpace.yaml $recipe,/tmp/dpace-only.yaml
python3 bench/optimizer_step.py --shape 8b --out "$OUT/optimizer-8b.json"
[ "${1:-}" = 8b-only ] && exit 0
python3 bench/optimizer_step.py --shape recipe --out "$OUT/optimizer-recipe.json"
i=0
for loss in ce dpace dpace ce; do
  i=$((i + 1))
  python3 bench/step_modes.py --config /tmp/$loss.yaml --variants layers:default \
    --out "$OUT/steps-$i-$loss.json" 2>&1 | tail -1 | cut -c1-300
done
