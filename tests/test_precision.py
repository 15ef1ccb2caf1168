"""dtype `auto` picks bf16 only where the hardware runs it natively."""

import subprocess
import sys

import pytest
import torch

from dflash.model import precision


@pytest.mark.parametrize(
    "avx512_bf16, amx, capability, onednn, native",
    [
        (True, False, "AVX512", None, True),  # Cooper Lake / Zen 4
        (False, True, "AVX512", None, True),  # Sapphire Rapids (AMX)
        (False, False, "AVX512", None, False),  # Skylake: AVX-512 without bf16
        (False, False, "AVX2", None, False),  # most laptops, Zen 2/3 servers
        (True, True, "AVX2", None, False),  # ATEN_CPU_CAPABILITY=avx2
        (True, True, "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2
    ],
)
def test_auto_is_bf16_only_with_native_bf16(
    monkeypatch, avx512_bf16, amx, capability, onednn, native
):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if onednn:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    expected = torch.bfloat16 if native else torch.float32
    assert precision.resolve_dtype("auto", "cpu") == expected
    assert precision.resolve_dtype("float32", "cpu") == torch.float32  # explicit wins
    assert precision.resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_the_avx2_fake_really_slows_bf16_and_auto_sees_it():
    """With the environment that makes an Intel CPU act as one without bf16 units, bf16 matmuls
    really are emulated (many times slower than fp32) and `auto` says fp32."""
    if not precision.cpu_runs_bf16_natively():
        pytest.skip("this CPU has no native bf16 to turn off")
    probe = (
        "import time, torch\n"
        "from dflash.model.precision import resolve_dtype\n"
        "def t(dtype):\n"
        "    a = torch.randn(512, 512, dtype=dtype); a @ a\n"
        "    s = time.perf_counter(); a @ a; return time.perf_counter() - s\n"
        "print(resolve_dtype('auto', 'cpu'), t(torch.bfloat16) / t(torch.float32))\n"
    )
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "torch.float32"
    assert float(out[1]) > 5  # measured ~290x on this machine's Xeon
