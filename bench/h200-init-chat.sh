#!/usr/bin/env bash
# Issue 34's own drafter.init case in one device session (bench/h200-init-chat.yaml): the
# chat-only recipe's drafter trained on the box, then fine-tuned onto the mixture's carried rows.
# After `install` (carry .whl), `stage .carry2c` and `stage .carry3c`, one call each:
#   bash bench/h200-init-chat.sh chat 560       # carry .carry4c: stage it, start the chat run, wait
#   bash bench/h200-init-chat.sh finetune 590   # carry .carrydata; again until the run ends
# `finetune` waits for the chat run; once it has ended it brings the chat drafter back under
# $OUT/chat, starts the fine-tune from /tmp/drafter-chat (the same target, not converted again)
# and waits for it. Called again, it only waits.
set -euo pipefail
cd "$(dirname "$0")/.."
H=bench/h200.sh
t0=$SECONDS
left() { echo $(($2 - (SECONDS - t0))); }

case $1 in
chat)
  bash $H stage .carry4c
  SPLITS="train eval" bash $H stages config/h200.yaml,bench/h200-no-vllm.yaml \
    target expand regenerate tokenize stats train
  bash $H wait "$(left x "$2")"
  ;;
finetune)
  if [ ! -d /tmp/drafter-chat ]; then
    bash $H wait "$2"
    if pgrep -f bench/stages.sh > /dev/null; then exit 0; fi # the chat run goes on: call again
    if [ ! -e /tmp/dflash-results/train/summary.json ]; then
      echo "the chat run ended without a trained drafter" >&2
      exit 1
    fi
    mkdir -p "$OUT/chat" && mv "$OUT"/results.tgz "$OUT"/drafter* "$OUT/chat/"
    cp -r /tmp/dflash-results/drafter /tmp/drafter-chat
    mv /tmp/dflash-results /tmp/chat
    if [ -L results ]; then rm results; fi
    bash $H unpack .carrydata
    mv /tmp/chat/target results/target # the same target: its conversion is reused
    SPLITS=eval bash $H stages \
      config/h200.yaml,config/h200-domains.yaml,bench/h200-no-vllm.yaml,bench/h200-init-chat.yaml \
      target expand regenerate tokenize stats train eval
  fi
  bash $H wait "$(left x "$2")"
  ;;
*)
  echo "usage: $0 chat|finetune SECONDS" >&2
  exit 2
  ;;
esac
