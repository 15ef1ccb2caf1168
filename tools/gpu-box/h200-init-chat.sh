#!/usr/bin/env bash
# Issue 34's own drafter.init case in one device session, with no regeneration: a chat drafter
# trained first on the ShareGPT rows of the math-mixture run's carried training split (.carrysg:
# 10,349 of its 19,286 rows, the chat-only recipe's source without CodeI/O, GSM8K and MATH),
# then fine-tuned from it onto the whole split (.carrydata) with tools/gpu-box/h200-init-chat.yaml.
# Both use the mixture's config, so held-out tau_sim is taken on the same 40 rows as the
# from-random run's (bench/results/2026-12-05-h100-domains-math.json).
# .carrysg from the split (and the same config's expand, on any machine: no GPU needed):
#   SOURCE=sharegpt EXPANDED=results/data/expanded/train.parquet DIR=.carrysg \
#     bash tools/gpu-box/carrydata.sh train.parquet train.report.json
# After `install` (carry .whl), `stage .carry2c` and `stage .carry3c`, one call each:
#   bash tools/gpu-box/h200-init-chat.sh chat 560       # carry .carry4c .carrysg: start the chat run, wait
#   bash tools/gpu-box/h200-init-chat.sh finetune 560   # carry .carrydata; again until the run ends
# `finetune` waits for the chat run; once it has ended it brings the chat run back under
# $OUT/chat, keeps its drafter in /tmp/drafter-chat, puts the whole split in its place and
# starts the fine-tune (target, expand and the eval split reused). Called again, it only waits.
# (2026-12-06: the two calls ran in 562 s and 422 s, the fine-tune's evaluation included.)
# $FINETUNE: one more config merged over the fine-tune's, e.g. FINETUNE=bench/h200-finetune.yaml
# (issue 57: the fine-tune's own peak lr, warmup and frozen layers).
set -euo pipefail
cd "$(dirname "$0")/../.."
H=tools/gpu-box/h200.sh
CONFIGS=config/h200.yaml,config/h200-domains.yaml,tools/gpu-box/h200-no-vllm.yaml
t0=$SECONDS
left() { echo $(($1 - (SECONDS - t0))); }

case $1 in
chat)
  bash $H stage .carry4c
  bash $H unpack .carrysg
  SPLITS=eval bash $H stages $CONFIGS target expand regenerate tokenize stats train
  bash $H wait "$(left "$2")"
  ;;
finetune)
  # /tmp/finetune-started is touched once the fine-tune runs: a hand-over that failed half-way
  # fails again, loudly, instead of turning later calls into plain waits
  if [ ! -e /tmp/finetune-started ]; then
    ls .carrydata/data.tar.part-* > /dev/null # carried? (nothing is moved before this)
    bash $H wait "$2"
    if pgrep -f gpu-box/stages.sh > /dev/null; then exit 0; fi # the chat run goes on: call again
    R=/tmp/dflash-results
    if [ ! -e $R/train/summary.json ]; then
      echo "the chat run ended without a trained drafter" >&2
      exit 1
    fi
    mkdir -p "${OUT:?}/chat" && mv "$OUT"/results.tgz "$OUT/chat/"
    mv "$OUT"/drafter* "$OUT/chat/" 2> /dev/null || echo "the chat drafter did not come back: too large"
    rm -rf /tmp/drafter-chat /tmp/chat && cp -r $R/drafter /tmp/drafter-chat
    mkdir -p /tmp/chat && mv $R/drafter $R/train $R/checkpoints $R/data/stats $R/logs /tmp/chat/
    mkdir -p $R/logs && cat .carrydata/data.tar.part-* | tar x -C $R # the whole split
    SPLITS=eval bash $H stages $CONFIGS,tools/gpu-box/h200-init-chat.yaml${FINETUNE:+,$FINETUNE} stats train eval
    touch /tmp/finetune-started
  fi
  bash $H wait "$(left "$2")"
  ;;
*)
  echo "usage: $0 chat|finetune SECONDS" >&2
  exit 2
  ;;
esac
