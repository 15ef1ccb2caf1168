#!/usr/bin/env bash
# `snakemake all` on a lent GPU box without network, over several calls of at most 10 minutes
# (what a call leaves in /tmp and in the ignored results/ folder stays while the box is warm).
# From the repository root, `bash tools/gpu-box/h200.sh SUBCOMMAND ...`:
#   install             wheels carried in .whl/ -> /tmp/site
#   probe CONFIG        CONFIG's compile warmup in the background (step times)
#   stage DIR           pinned wheels (or parts of one) carried in DIR -> /tmp/stage
#   cache               the staged wheels (parts joined) into the wheel cache
#   start8b DIR         the 8B rehearsal: DIR (.carry8b) staged, then start
#                       config/rehearsal-8b.yaml, GPU memory and disk sampled
#   start CONFIG...     cache, then snakemake all --keep-going with the config files, later over
#                       earlier (or the targets in $TARGETS; $PRIORITIZE: a file Snakemake makes
#                       first) under setsid (a killed run is unlocked and resumed), from a copy of
#                       the tree in /tmp/dflash-src
#   wait SECONDS        progress until the run ends or SECONDS pass; results to $OUT
#   stages CONFIG[,CONFIG...] STAGE...
#                       tools/gpu-box/stages.sh in the background, as `start` runs Snakemake;
#                       several config files are merged as --configfile merges them ($DRAFTER: a
#                       trained drafter to evaluate, $SPLITS: the splits to regenerate)
#   beside DIR CONFIGS ACCEPTANCE STAGE...
#                       a second drafter (DIR) evaluated beside the run `stages` started, on its
#                       target and rows, in /tmp/beside
#   vllm                the staged vLLM bundle's parts joined and installed in /tmp/vllm-site,
#                       last on PYTHONPATH: a run already going finds vLLM from its next job on,
#                       its other packages kept
#   sglang              the staged SGLang bundle's parts joined and installed in /tmp/sglang-site,
#                       which eval.sglang.site names (tools/gpu-box/h200-serving.yaml): only the
#                       engine processes of eval_sglang put it on their path
#   unpack DIR          results/ files brought back earlier (DIR/data.tar.part-*, e.g. a run's
#                       tokenized training rows: .carrydata from tools/gpu-box/carrydata.sh) into
#                       results/: tools/gpu-box/stages.sh then skips the stages whose outputs they are
# A wheel too large for one call travels as NAME.whl.part-a, NAME.whl.part-b, ... (split -b, or
# head/tail as tools/gpu-box/h200-carry.sh cuts the target's), joined in name order.
# 2026-12-01, 5 calls: install (.whl, 60 MiB), stage (smollm2 part a + ShareGPT), stage (parts b,
# c + MT-Bench), sqlalchemy (Snakemake needs it; it did not fit in .whl), then start + wait.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD:/tmp/vllm-site PYTHONUNBUFFERED=1
RUN=/tmp/dflash-run
RUNNING="snakemake --cores|gpu-box/stages.sh"  # what `wait` waits for
mkdir -p "$RUN" /tmp/stage

# The run reads its own copy of the tree: the device tool copies the working tree afresh at every
# call, and Snakemake's parse (or a job) starting during that copy found files missing
# (2026-12-04: FileNotFoundError dflash/__init__.py). What a run keeps (results/, Snakemake's
# metadata, the converted target in resources/) lives in /tmp beside the copy, linked into it, so
# a restarted run resumes; results/ is also linked from the tree, for `wait`.
SRC=/tmp/dflash-src
refuse_if_running() {
  if pgrep -f "$RUNNING" > /dev/null; then
    echo "a run is going (pgrep -f '$RUNNING'): wait for it, or kill it first" >&2
    exit 1
  fi
}
copy_tree() {
  local RES=/tmp/dflash-results STATE=/tmp/dflash-state
  # a results/ folder in the tree (from `unpack`) becomes the run's, but never over a run's own:
  # 2026-12-05 a `mkdir -p results/target` in the tree replaced a finished run's results
  if [ -d results ] && [ ! -L results ]; then
    if [ -n "$(ls -A "$RES" 2>/dev/null)" ]; then
      echo "results/ here is a folder and $RES holds a run's results: not replacing them" \
        "(remove one of the two first)" >&2
      exit 1
    fi
    rm -rf "$RES" && mv results "$RES"
  fi
  mkdir -p "$RES" "$STATE/.snakemake" "$STATE/resources" && ln -sfn "$RES" results
  rm -rf "$SRC" && mkdir -p "$SRC"
  # (the carried wheels stay behind; .carryinit, a drafter to start from, comes along)
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake \
    --exclude='./.carry[0-9vs]*' --exclude=./.whl --exclude=./.venv --exclude=./.git . |
    tar xf - -C "$SRC"
  ln -s "$RES" "$SRC/results"
  ln -s "$STATE/.snakemake" "$SRC/.snakemake" && ln -s "$STATE/resources" "$SRC/resources"
}

merge_configs() {  # OUT CONFIG[,CONFIG...]: merged as Snakemake merges --configfile (a later
  # file over the earlier ones, lists replaced whole), for tools/gpu-box/stages.sh, which reads one
  python3 -c 'import sys, yaml; from snakemake.utils import update_config
config = {}
for path in sys.argv[2].split(","): update_config(config, yaml.safe_load(open(path)))
yaml.safe_dump(config, open(sys.argv[1], "w"))' "$1" "$2"
}

case $1 in
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, polars, snakemake; print('torch', torch.__version__, 'transformers', transformers.__version__, 'polars', polars.__version__)"
  ;;
merge)  # OUT CONFIG[,CONFIG...]: the configs as one file (merge_configs), for scripts on the box
  merge_configs "$2" "$3"
  ;;
probe)  # CONFIG's compile warmup on random weights, in the background: step times per bucket
  # shape before the run starts, and a warm compile cache for it
  setsid nohup python3 -m dflash warmup --config "$2" --target config/models/smollm2-135m \
    --record "$RUN/probe.json" --cache-dir results/compile-cache > "$RUN/probe.log" 2>&1 < /dev/null &
  ;;
stage)
  cp "$2"/* /tmp/stage/
  ls -la /tmp/stage
  grep "warmup {" "$RUN/probe.log" 2>/dev/null || true
  ;;
cache)  # the staged wheels (parts joined) into fetch_wheel's cache: <cache_dir>/wheels/<sha256>/
  for part in /tmp/stage/*.whl.part-a; do
    [ -e "$part" ] || continue
    whole=${part%.part-a}
    cat "${whole}".part-* > "$whole" && rm "${whole}".part-*
  done
  for whl in /tmp/stage/*.whl; do
    sha=$(sha256sum "$whl" | cut -d' ' -f1)
    mkdir -p ~/.cache/dflash/wheels/"$sha"
    cp "$whl" ~/.cache/dflash/wheels/"$sha"/
    echo "cached $(basename "$whl") $sha"
  done
  ;;
start8b)  # config/rehearsal-8b.yaml: the carried folder staged, SQLAlchemy installed, started
  cp "$2"/* /tmp/stage/
  setsid nohup nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu \
    --format=csv,noheader -l 5 > "$RUN/gpu-memory.csv" 2>&1 < /dev/null &
  setsid nohup bash -c 'while sleep 5; do df -B1 --output=used / | tail -1; done' \
    > "$RUN/disk.log" 2>&1 < /dev/null &
  bash "$0" start config/rehearsal-8b.yaml
  ;;
start)
  # Snakemake needs SQLAlchemy, which did not fit in .whl: carried beside the data wheels
  if ls /tmp/stage/sqlalchemy-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site /tmp/stage/sqlalchemy-*.whl /tmp/stage/greenlet-*.whl
    rm /tmp/stage/sqlalchemy-*.whl /tmp/stage/greenlet-*.whl
  fi
  bash "$0" cache
  refuse_if_running
  copy_tree
  cd "$SRC" && export PYTHONPATH=/tmp/site:$SRC:/tmp/vllm-site
  SMK=(python3 -m snakemake --cores all --scheduler greedy --keep-going ${TARGETS:-all}
    ${PRIORITIZE:+--prioritize "$PRIORITIZE"} --configfile "${@:2}")
  "${SMK[@]}" --unlock > /dev/null 2>&1 || true
  echo "start $(date +%s)" >> "$RUN/events"
  setsid nohup "${SMK[@]}" > "$RUN/snakemake.log" 2>&1 < /dev/null &
  echo "snakemake started: $RUN/snakemake.log"
  ;;
stages)  # tools/gpu-box/stages.sh CONFIG STAGE... in the background from the tree's copy, for a drafter
  # already trained: $DRAFTER (an exported drafter's folder, e.g. under .carryinit) is copied to
  # results/drafter first, and only $SPLITS (default: train eval) are regenerated and tokenized
  refuse_if_running
  copy_tree
  if [ -n "${DRAFTER:-}" ]; then mkdir -p results/drafter && cp "$DRAFTER"/* results/drafter/; fi
  # after `start`, the target Snakemake converted (resources/) is tools/gpu-box/stages.sh's target too,
  # when it is the only one there (with two, which one CONFIG names is not guessed)
  converted=(/tmp/dflash-state/resources/target/*/hf)
  if [ ${#converted[@]} -eq 1 ] && [ -d "${converted[0]}" ] && [ ! -e results/target/hf ]; then
    mkdir -p results/target && ln -sfn "${converted[0]}" results/target/hf
    cp "$(dirname "${converted[0]}")/target.json" results/target/target.json 2>/dev/null || true
  fi
  cd "$SRC" && export PYTHONPATH=/tmp/site:$SRC:/tmp/vllm-site
  bash "$0" cache
  merge_configs "$RUN/config.yaml" "$2"
  echo "start $(date +%s)" >> "$RUN/events"
  setsid nohup bash tools/gpu-box/stages.sh "$RUN/config.yaml" results "${@:3}" > "$RUN/snakemake.log" 2>&1 < /dev/null &
  echo "tools/gpu-box/stages.sh started: $RUN/snakemake.log"
  ;;
beside)  # DIR CONFIG[,CONFIG...] ACCEPTANCE STAGE...: a second drafter, carried in DIR as `wait`
  # brings one back (drafter-config.json, drafter.safetensors.part-*), evaluated beside the run
  # that `stages` started, on that run's target and expanded rows (waited for), in /tmp/beside:
  # e.g. the other side of a paired study in the same stay (at the recipe's small shapes one
  # process leaves the GPU idle between its kernels, so two share it well). ACCEPTANCE: that drafter's own
  # acceptance.json (sample-eval's greedy τ per prompt). Only the eval split is regenerated
  # (with CONFIG's data.regenerate: tau_sim off its answers). `wait` waits for it too.
  B=/tmp/beside A=/tmp/dflash-results
  if pgrep -f "stages.sh $B/config.yaml" > /dev/null; then
    echo "a beside run is going in $B: wait for it, or kill it first" >&2
    exit 1
  fi
  rm -rf "$B" && mkdir -p "$B/results/drafter" "$B/results/eval" "$B/results/data/expanded"
  cat "$2"/drafter.safetensors.part-* > "$B/results/drafter/model.safetensors"
  cp "$2/drafter-config.json" "$B/results/drafter/config.json"
  cp "$4" "$B/results/eval/acceptance.json"
  merge_configs "$B/config.yaml" "$3"
  for _ in $(seq 60); do  # the target converted and the rows expanded (each written atomically)
    [ -e "$A/target/target.json" ] && [ -e "$A/data/expanded/eval.parquet" ] && break
    sleep 5
  done
  if [ ! -e "$A/target/target.json" ] || [ ! -e "$A/data/expanded/eval.parquet" ]; then
    echo "beside: no target or expanded rows in $A after 300 s: start \`stages\` first" >&2
    exit 1
  fi
  cp -r "$A/target" "$B/results/target" && cp "$A/data/expanded/eval.parquet" "$B/results/data/expanded/"
  cd "$SRC" && export PYTHONPATH=/tmp/site:$SRC:/tmp/vllm-site
  # GPU locks of its own: the GPU is shared on purpose, not queued behind the other run's jobs.
  # But not beside its regeneration or training: one regeneration peaks at 61 GB at the recipe's
  # batch, so two did not fit an 80 GB H100 (2026-12-08: the first run's failed, out of memory).
  # The wait is in the background, for a run of `stages` or of `start` (Snakemake); "[.]" and "[ ]"
  # so that pgrep does not find the waiting command line itself.
  SPLITS=eval DFLASH_GPU_LOCKS=$B/gpu-locks setsid nohup bash -c "
    while [ ! -e $A/train/summary.json ] && pgrep -f 'stages[.]sh $RUN/config.yaml|snakemake[ ]--cores' > /dev/null; do
      sleep 5
    done
    exec bash tools/gpu-box/stages.sh $B/config.yaml $B/results ${*:5}" > "$B/stages.log" 2>&1 < /dev/null &
  echo "beside: tools/gpu-box/stages.sh queued in $B (it starts once the first run's training has ended) ($(sha256sum < "$B/results/drafter/model.safetensors" | cut -c1-16)...)"
  ;;
vllm)  # the vLLM bundle carried in parts (tools/gpu-box/vllm-wheels.sh DIR, then `stage` each
  # DIR/parts/vllm-bundle.tar.part-*): joined, unpacked and installed beside the other packages
  cat /tmp/stage/vllm-bundle.tar.part-* | tar x -C /tmp/stage && rm /tmp/stage/vllm-bundle.tar.part-*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/vllm-site /tmp/stage/wheels/*.whl
  python3 -c "import vllm; print('vllm', vllm.__version__)"
  ;;
sglang)  # as `vllm`, for tools/gpu-box/sglang-wheels.sh's parts, into a site of its own
  mkdir -p /tmp/stage/sglang && cat /tmp/stage/sglang-bundle.tar.part-* | tar x -C /tmp/stage/sglang
  rm /tmp/stage/sglang-bundle.tar.part-*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/sglang-site /tmp/stage/sglang/wheels/*.whl
  PYTHONPATH=/tmp/sglang-site python3 -c "import sglang; print('sglang', sglang.__version__)"
  ;;
unpack)
  mkdir -p results && cat "$2"/data.tar.part-* | tar x -C results
  find results/data -name '*.parquet' | sort
  ;;
wait)
  # the device tool drops the tree's ignored links between calls: the run's results/ linked again
  if [ -d /tmp/dflash-results ] && { [ -L results ] || [ ! -e results ]; }; then
    ln -sfn /tmp/dflash-results results
  fi
  deadline=$((SECONDS + $2))
  while [ $SECONDS -lt "$deadline" ]; do
    sleep 20
    pgrep -f "$RUNNING" > /dev/null || break
    echo "$(date +%T) $(grep -cE '^Finished jobid' "$RUN/snakemake.log") jobs done; $(ls -t results/logs/*.log 2>/dev/null | head -1 | xargs -r tail -c 300 | tr '\r' '\n' | tail -1)"
  done
  grep -E "^\[|^(local)?rule |^Finished jobid|rror|^[a-z]+: (start|done|FAILED)" "$RUN/snakemake.log" |
    tail -60
  if [ -n "${OUT:-}" ]; then  # at most 8 files come back: one archive and the drafter's parts
    files=$(cd results && ls summary.md MANIFEST.json eval/*.json train/metrics.jsonl train/summary.json \
      data/stats/stats.json data/*/report.json data/tokenized/*.report.json compile/warmup.json \
      manifests/*.json logs/*.log sweep/*/eval/*.json sweep/*/train/summary.json \
      sweep/*/train/metrics.jsonl sweep/*/config.yaml sweep/*/sweep.log sweep/*/data/expanded/report.json \
      pair/*/eval/*.json pair/*/train/summary.json \
      pair/*/train/metrics.jsonl pair/*/config.yaml pair/*/logs/*.log pair/*/data/*/report.json 2>/dev/null || true)
    cp "$RUN/snakemake.log" results/logs/snakemake.run.log
    cp "$RUN"/gpu-memory.csv "$RUN"/disk.log results/logs/ 2>/dev/null || true
    (cd results && tar czf "$OUT/results.tgz" $files logs/snakemake.run.log \
      $(ls logs/gpu-memory.csv logs/disk.log target/target.json 2>/dev/null) \
      $(find checkpoints -name meta.json -o -name '*.jsonl' 2>/dev/null | head -20))
    du -sh results/* results/checkpoints/* 2>/dev/null | sort -h | tail -12
    # the drafter travels back in parts when it is small (a 135M target's); at 8B shapes it is GBs
    if [ -e results/drafter/model.safetensors ] && \
      [ "$(stat -c %s results/drafter/model.safetensors)" -lt 60000000 ]; then
      split -b 15000000 results/drafter/model.safetensors "$OUT/drafter.safetensors.part-"
      cp results/drafter/config.json "$OUT/drafter-config.json"
    fi
  fi
  if [ -n "${OUT:-}" ] && [ -d /tmp/beside/results/eval ]; then  # `beside`'s results
    tail -5 /tmp/beside/stages.log || true
    (cd /tmp/beside && tar czf "$OUT/beside.tgz" stages.log config.yaml results/eval \
      results/logs $(ls results/data/*/report.json results/data/tokenized/*.report.json 2>/dev/null))
  fi
  pgrep -f "$RUNNING" > /dev/null && echo "STILL RUNNING" || echo "SNAKEMAKE ENDED"
  ;;
esac
