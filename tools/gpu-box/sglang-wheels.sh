#!/usr/bin/env bash
# Downloads the wheel set with which SGLang 0.5.17 serves a DFlash drafter
# (`--speculative-algorithm DFLASH`) on the GPU machine's image (torch 2.11.0+cu130, CUDA 13,
# Python 3.12, x86_64), into DIR, checks that it installs whole there, then splits it into parts
# under 60 MB for carrying:
#   bash tools/gpu-box/sglang-wheels.sh DIR     # DIR/parts/sglang-bundle.tar.part-aa, -ab, ...
# On the GPU machine: cat the parts, tar x, pip install --no-deps --target SITE wheels/*.whl, and
# put SITE first on the engine process's PYTHONPATH only (eval.sglang.site).
# The set is the closure of sglang==0.5.17's requirements (the wheel is cp312
# manylinux_2_34 only), its own pins kept (flashinfer-python 0.6.15.post1 and sglang-kernel 0.4.5,
# which its engine asserts at start; apache-tvm-ffi 0.1.11, nvidia-cutlass-dsl 4.6.0, openai 2.6.1,
# xgrammar 0.2.1, transformers 5.12.1), minus what the image holds
# (tools/gpu-box/image-packages.txt: torch, torchaudio, triton, the nvidia-* CUDA libraries);
# unpinned requirements at their newest release before sglang 0.5.17's (2026-08-08), except where
# that broke a pin of the set: flash-attn-4 4.0.0b19 (only 4.0.0b* prereleases exist, so a bare
# `pip download flash-attn-4` finds nothing without --pre; b20 and later need
# apache-tvm-ffi >= 0.1.12 and nvidia-cutlass-dsl 4.6.0.dev0), quack-kernels 0.6.1 (0.6.2 needs
# nvidia-cutlass-dsl 4.6.1), grpcio-health-checking and grpcio-reflection 1.81.1 (protobuf < 7, as
# nvidia-cutlass-dsl's libs). transformers 5.12.1 and tokenizers 0.22.2 (5.12.1 takes
# tokenizers <= 0.23.0) shadow the image's 5.17.0 and 0.23.2 in the engine's process only: SGLang
# pins ==5.12.1 and patches transformers' internals (srt/utils/hf_transformers_patches.py).
# mistral-common wants numpy < 2.4 against the image's 2.5.2, as in vLLM's bundle, which served.
# Left out on purpose (about 370 MB; sglang's source imports them only on paths DFlash on a dense
# target does not take): tilelang 0.1.11 and its z3-solver (DeepSeek sparse attention kernels,
# imported inside functions of srt/layers/attention/dsa*), tokenspeed-mla and its 87 MB
# tokenspeed-triton (the tokenspeed_mla attention backend only), nvidia-cutlass-dsl-libs-cu12
# (cutlass picks the newest flavor the driver supports, cu13 here), and nvidia-cuda-nvcc, -crt,
# nvidia-nvvm and nvidia-cuda-cccl (asked by humming-kernels[cu13], quantized MoE only; the image
# has its own nvcc 13.0 for flashinfer's JIT).
set -euo pipefail
dir=${1:?usage: sglang-wheels.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$dir/wheels" "$dir/parts" && mkdir -p "$dir/wheels" "$dir/parts"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$dir/wheels" \
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 sgl-deep-gemm==0.1.5.post1 \
  transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5 \
  flash-attn-4==4.0.0b19 quack-kernels==0.6.1 nvidia-cutlass-dsl==4.6.0 \
  nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0 \
  nvidia-cutlass-dsl-libs-cu13==4.6.0 nvidia-cuda-nvdisasm==13.3.73 nvidia-mathdx==25.6.0 \
  nvidia-cudnn-frontend==1.27.0 cuda-python==13.3.1 cuda-tile==1.5.0 nccl4py==0.3.1 \
  helion==1.4.0 filecheck==1.0.3 humming-kernels==0.1.10 \
  kernels==0.14.1 kernels-data==0.16.0 torchao==0.17.0 torchcodec==0.11.1 \
  torch-memory-saver==0.0.9.post1 xgrammar==0.2.1 llguidance==1.7.6 outlines==0.1.11 \
  outlines-core==0.1.26 interegular==0.3.3 lark==1.3.1 airportsdata==20260803 pycountry==26.2.16 \
  nest-asyncio==1.6.0 diskcache==5.6.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.6.3 \
  openai==2.6.1 openai-harmony==0.0.4 anthropic==1.13.0 jiter==0.16.0 distro==1.9.0 \
  docstring-parser==0.18.0 sniffio==1.3.1 httpx2==2.13.1 httpcore2==2.13.1 truststore==0.10.4 \
  fastapi==0.142.2 starlette==1.7.0 uvicorn==0.54.0 python-multipart==0.0.32 watchfiles==1.2.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.4 \
  pydantic-extra-types==2.11.1 mistral-common==1.12.0 compressed-tensors==0.18.0 gguf==0.19.0 \
  smg-grpc-servicer==0.8.0 smg-grpc-proto==0.4.14 grpcio-health-checking==1.81.1 \
  grpcio-reflection==1.81.1 opentelemetry-api==1.45.0 \
  datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 modelscope==1.39.1 modelscope-hub==0.2.0 \
  pycryptodomex==3.23.0 blobfile==3.0.0 \
  ipython==9.17.1 ipython-pygments-lexers==1.1.1 jedi==0.20.0 parso==0.8.7 \
  matplotlib-inline==0.2.2 traitlets==5.16.1 pexpect==4.9.0 ptyprocess==0.7.0 \
  prompt-toolkit==3.0.53 wcwidth==0.9.1 stack-data==0.6.3 asttokens==3.0.2 executing==2.2.1 \
  pure-eval==0.2.4 \
  msgspec==0.21.1 orjson==3.11.9 partial-json-parser==0.2.1.1.post7 pybase64==1.5.0 \
  pyzmq==27.1.0 setproctitle==1.3.7 py-spy==0.4.2 easydict==1.13 soundfile==0.13.1 cffi==2.1.1 \
  pycparser==3.0 zstandard==0.25.0 loguru==0.7.3 pyelftools==0.33 tomlkit==0.15.1
python3 "$here/wheel_closure.py" "$dir/wheels" --accept mistral-common:numpy --leave tilelang \
  --leave tokenspeed-mla --leave nvidia-cutlass-dsl-libs-cu12 --leave nvidia-cuda-nvcc \
  --leave nvidia-cuda-cccl
tar cf "$dir/sglang-bundle.tar" -C "$dir" wheels
split -b 60000000 "$dir/sglang-bundle.tar" "$dir/parts/sglang-bundle.tar.part-"
rm "$dir/sglang-bundle.tar"
ls -la "$dir/parts"
