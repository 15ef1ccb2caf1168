#!/usr/bin/env bash
# Downloads the wheel set with which vLLM 0.24.0 served a DFlash drafter on the GPU machine's image
# (torch 2.11.0, Python 3.12), into DIR, then splits it into parts under 60 MB for carrying:
#   bash tools/gpu-box/vllm-wheels.sh DIR      # DIR/parts/vllm-bundle.tar.part-aa, -ab, ...
# (tools/gpu-box/h200-carry.sh runs it with VLLM=1)
# On the GPU machine: cat the parts, tar x, pip install --no-deps --target SITE wheels/*.whl.
# Pins follow vLLM 0.24.0's own requirements where newer releases broke it there (openai 3.x
# needs httpx2; xgrammar 0.2.9 needs a newer apache-tvm-ffi than 0.24.0's 0.1.9; fastapi >= 0.137
# imports opentelemetry differently); flashinfer-python is imported by the sampler, the cubin
# package is not needed.
set -euo pipefail
dir=${1:?usage: vllm-wheels.sh DIR}
mkdir -p "$dir/wheels" "$dir/parts"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$dir/wheels" \
  vllm==0.24.0 flashinfer-python==0.6.12 apache-tvm-ffi==0.1.9 xgrammar==0.2.1 llguidance==1.7.6 \
  openai==2.54.0 openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.0.1 \
  compressed-tensors==0.17.0 depyf==0.20.0 diskcache==5.6.3 lark==1.2.2 outlines_core==0.2.14 \
  lm-format-enforcer==0.11.3 mistral-common==1.13.1 gguf==0.19.0 \
  astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0 ijson==3.6.0 jiter==0.19.0 \
  msgspec==0.23.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 python-json-logger==4.2.0 \
  pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 watchfiles==1.3.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-semantic-conventions-ai==0.5.1 importlib-metadata==10.2.0 python-multipart==0.0.34 \
  uvicorn==0.55.0 mcp==1.30.0 httpx-sse==0.4.3 sse-starlette==3.7.1 pydantic-settings==2.16.3 \
  python-dotenv==1.2.4 anthropic==2.16.0 docstring-parser==0.18.0 prometheus-fastapi-instrumentator==8.1.0 \
  email-validator==2.4.0 dnspython==2.9.2
tar cf "$dir/vllm-bundle.tar" -C "$dir" wheels
split -b 60000000 "$dir/vllm-bundle.tar" "$dir/parts/vllm-bundle.tar.part-"
rm "$dir/vllm-bundle.tar"
ls -la "$dir/parts"
