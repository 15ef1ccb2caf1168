"""`bench/gpu.py`'s common ground: the timing, peak-memory and profiling helpers every section
uses, the JSON report written after each section, the ceilings (a bf16 matmul and a copy: the
rates the other sections are measured against) and the workload's rows."""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch

KERNEL_KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("flex attention", ("flex_attention", "flex_decoding")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_")),
    ("CE softmax and gradient", ("logsumexp",)),
    ("inductor fused (norms, RoPE, SiLU, casts)", ("triton_",)),
    ("AdamW", ("adam",)),
    ("clip (norms, scaling)", ("multi_tensor", "foreach", "norm")),
    ("eager copies and casts", ("copy", "memcpy", "memset")),
)


def kernel_split(averages) -> dict:
    """Device milliseconds of one profiled call by kernel kind: where the non-matmul time goes."""
    split: dict[str, float] = {}
    for e in averages:
        if e.device_type != torch.autograd.DeviceType.CUDA or not e.self_device_time_total:
            continue
        if e.key.startswith("Optimizer."):  # the optimizer's annotation over its own kernels
            continue
        name = e.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")
        split[kind] = split.get(kind, 0.0) + e.self_device_time_total / 1e3
    split = {k: round(v, 2) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}
    return {"device_ms": split, "device_ms_total": round(sum(split.values()), 2)}


class BenchBase:
    """What every section uses: `bench/gpu.py`'s `Bench` adds the sections."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.report: dict = {"sections": {}}
        self.started = time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn, warmup: int, reps: int) -> tuple[float, list[float]]:
        """Median wall seconds of `fn` (synchronised), and the first warm-up call's seconds."""
        first = None
        for _ in range(warmup):
            t0 = time.perf_counter()
            fn()
            self.sync()
            first = first if first is not None else time.perf_counter() - t0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), {"first_s": first, "times_s": [round(t, 5) for t in times]}

    def reset_peak(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        return 0

    def peak_gb(self, base: int = 0):
        if not self.cuda:
            return None
        return round((torch.cuda.max_memory_allocated(self.device) - base) / 1e9, 2)

    def save(self, name: str, value) -> None:
        self.report["sections"][name] = value
        self.report["wall_s"] = round(time.perf_counter() - self.started, 1)
        Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.out).write_text(json.dumps(self.report, indent=1))
        print(f"[{self.report['wall_s']:7.1f}s] {name}: {json.dumps(value)[:600]}", flush=True)

    def profile(self, name: str, fn) -> None:
        """Top kernels of one call by device time, to $OUT/profile-NAME.txt."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        fn()
        self.sync()
        with profile(activities=acts) as prof:
            fn()
            self.sync()
        key = "device_time_total" if self.cuda else "cpu_time_total"
        averages = prof.key_averages()
        text = averages.table(sort_by=key, row_limit=80, max_name_column_width=90)
        (Path(self.args.out).parent / f"profile-{name}.txt").write_text(text)
        if self.cuda:
            self.report.setdefault("profiles", {})[name] = kernel_split(averages)

    def ceilings(self):
        """Section 1: what the device does at best (the other sections' yardsticks)."""
        n = 8192 if not self.args.small else 256
        g = torch.Generator(device=self.device).manual_seed(0)
        a = [torch.randn(n, n, device=self.device, generator=g, dtype=torch.bfloat16) for _ in "ab"]
        reps = 10

        def mm():
            for _ in range(reps):
                a[0] @ a[1]

        t, _ = self.timed(mm, 2, 5)
        matmul = 2 * n**3 * reps / t
        x = torch.randn(2**28 if not self.args.small else 2**20, device=self.device)
        y = torch.empty_like(x)
        t_copy, _ = self.timed(lambda: y.copy_(x), 2, 10)
        out = {
            "matmul_bf16_tflops": round(matmul / 1e12, 1),
            "copy_tb_s": round(2 * x.numel() * 4 / t_copy / 1e12, 2),
        }
        self.matmul_rate = matmul
        self.save("ceilings", out)

    def rows(self, batch: int, seed: int):
        """(ids, loss_mask, attention, lengths): right-padded rows of one bucket, lengths uniform
        in (0.6 L, L], the first quarter of each row a prompt (untrainable)."""
        L, vocab = self.args.length, self.target_cfg.vocab_size
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(int(0.6 * L) + 1, L + 1, (batch,), generator=g)
        ids = torch.randint(4, vocab, (batch, L), generator=g)
        pos = torch.arange(L)[None]
        attention = (pos < lengths[:, None]).long()
        loss_mask = attention * (pos >= (lengths // 4)[:, None]).long()
        ids = ids * attention
        d = self.device
        return ids.to(d), loss_mask.to(d), attention.to(d), lengths.tolist()
