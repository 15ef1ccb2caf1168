"""dtype `auto`: bf16 where the hardware runs it natively, fp32 everywhere else.

A CPU without bf16 units (AVX2 only: many laptops and AMD servers) emulates bf16 matmuls at
about 1/77 of its fp32 speed (measured: 0.86 vs 66 GFLOP/s), so bf16 must never be the silent
choice there. Native means a CUDA device with bf16, or an x86 CPU with AVX512-BF16 or AMX that
torch and oneDNN are allowed to use: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` makes an
Intel CPU behave (and be treated) like one without them.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# oneDNN ISA caps below AVX512_CORE_BF16: bf16 matmuls are emulated under them
ONEDNN_WITHOUT_BF16 = {
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
}


def cpu_runs_bf16_natively() -> bool:
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    aten = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() not in ONEDNN_WITHOUT_BF16
    return hardware and aten and onednn


def native_bf16(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_runs_bf16_natively()


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype a config's `dtype` names on this device (`auto`: see the module doc)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return DTYPES[name]
