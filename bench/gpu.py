"""GPU performance of DFlash training at real shapes, in one command (issues 7 and 17).

    python bench/gpu.py [--out results.json]          # on the GPU machine, repo root on PYTHONPATH
    python bench/gpu.py --sections drafter,warm --anchors 512 --profile   # a part of it
    python bench/gpu.py --small --device cpu           # tiny shapes: checks the script's logic

On whatever GPUs it finds, with random-init models of real shapes (a Qwen3-8B-shaped target from
bench/qwen3-8b-config and its 5-layer B=16 drafter) and rows whose lengths are uniform in
(0.6 L, L] (L = 2560: mean 2048 tokens, one bucket), it measures side by side, in this order:

1. ceilings: a bf16 8192^3 matmul on random data and a device-to-device copy;
2. target features: the naive full forward (all layers, LM head, every hidden state) vs the
   early stop (`TargetFeatures`): transformers' forward with the padding mask, then the
   production path without it (a right-padded mask is dropped), its layers written out
   (`dflash.model.decoder`), eager and compiled (`compile.target`); tokens/s and the fraction of
   the forward's roofline;
3. the LM-head CE alone: full logits vs checkpointed chunks vs the fused chunked CE: peak memory
   above its inputs and time;
4. the drafter training step (forward, backward, grad clip, AdamW) at 512 and 256 anchors per
   sample: the naive reference (eager, SDPA with a dense mask, full logits, foreach AdamW) vs the
   compiled flex_attention step with checkpointed CE vs the production step (`TrainStep`:
   layers compiled, flex_attention, fused chunked CE, fused AdamW; `--before` adds the whole
   drafter compiled); step time, tokens/s, TFLOP/s, MFU, peak memory, the device time of the
   forward, backward and optimizer (CUDA events) and, with `--profile`, kernel time by kind;
5. the warm start: a fresh process pointed at this run's compile cache runs the warmup rule's
   own code on the last drafter case's shape: seconds to import what training imports, each
   graph's first call, dynamo's compile-time split and the cache hits (what still compiles);
6. the pipeline: `dflash train` under torchrun as the rule runs it (bench/pipeline.py), 1 target +
   1 drafter when 2 GPUs are lent, colocated 0+1 with one; tokens/s per GPU against a colocated
   naive estimate (naive target + naive step, both measured in 2 and 4 at the pipeline's shape),
   and the trainer's seconds to its first step from the cache the sections above filled.

Last, issue 17's goals, each met, not met or not measured. `--sections` runs a subset (the
ceilings always run).

FLOPs are useful work only (bench/drafter_step.py's `useful_flops`): context K/V projections and
`fc` over the real context tokens, block tokens of real anchors through all layers, attention
over the keys each query may see, the frozen LM head on block tokens; backward = 2x forward for
trained parts, 1x for the head (input gradient only). MFU is against 989 TFLOP/s (H100/H200 SXM
dense bf16); the measured matmul rate is reported beside it. Every compile lands in one
inductor cache, so the pipeline's drafter finds its graphs there. Prints a table last; writes
JSON after every section.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16, datasheet
SPECFORGE_PER_GPU = 3400  # SpecForge's reported tokens/s per GPU at 256 anchors (issue 7)
TINY_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
}


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.report: dict = {"sections": {}}
        self.started = time.perf_counter()

    # ---- helpers -------------------------------------------------------------------------

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

    # ---- 1. ceilings ---------------------------------------------------------------------

    def ceilings(self):
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

    # ---- workload ------------------------------------------------------------------------

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

    # ---- 2. target features --------------------------------------------------------------

    def target_flops(self, lengths, layers: int, head: bool):
        c = self.target_cfg
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        h, nq, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        per_token = 2 * (h * nq * d * 2 + h * nkv * d * 2 + 3 * h * c.intermediate_size)
        total = 0
        for n in lengths:
            total += layers * (n * per_token + 4 * d * nq * n * (n + 1) // 2)
            total += 2 * n * h * c.vocab_size if head else 0
        return total

    def target_section(self):
        from transformers import AutoModelForCausalLM

        from dflash.model.target import TargetFeatures

        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(self.target_cfg, dtype=self.dtype)
        model.eval().requires_grad_(False)
        # The production target's attention as training loads it (the model's default).
        layer_ids = self.dcfg.target_layer_ids
        ids, _, attention, lengths = self.rows(self.pipe_batch, seed=1)
        tokens = sum(lengths)
        L = self.args.length
        warm, reps = (1, 3) if self.cuda else (1, 1)
        results = {}

        @torch.no_grad()
        def naive():
            out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
            return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.logits

        base = self.reset_peak()
        t, info = self.timed(naive, warm, reps)
        info["peak_gb"] = self.peak_gb(base)
        n_layers = self.target_cfg.num_hidden_layers
        # The pipeline's target: these very weights, written to disk later (start_target_save).
        self.target_state = dict(model.state_dict()) if self.pipeline_topologies else None
        results["naive full forward + logits, mask"] = self.target_row(
            t, info, lengths, n_layers, True, tokens
        )
        with torch.no_grad():
            full_hidden = model(
                input_ids=ids, attention_mask=attention, output_hidden_states=True
            ).hidden_states
            expected = torch.cat([full_hidden[i + 1] for i in layer_ids], dim=-1)
            del full_hidden
        # Keep the frozen embedding and LM head for the drafter (as training does); copies,
        # since the target is converted to fp32 below.
        self.embed = torch.nn.Embedding.from_pretrained(
            model.get_input_embeddings().weight.detach().clone(), freeze=True
        )
        self.head = model.get_output_embeddings().weight.detach().clone()
        n0 = lengths[0]
        row0 = {"naive full forward + logits, mask": expected[0, :n0].clone()}
        feats = TargetFeatures(model, layer_ids)
        kept = max(layer_ids) + 1
        valid = attention.bool()

        def rel_err(got, ref=expected):
            return round(
                (
                    (got[valid].float() - ref[valid].float()).norm() / ref[valid].float().norm()
                ).item(),
                5,
            )

        def early_stop(name):
            base = self.reset_peak()
            t, info = self.timed(lambda: feats(ids, attention), warm, reps)
            info["peak_gb"] = self.peak_gb(base)
            row = self.target_row(t, info, lengths, kept, False, tokens)
            got = feats(ids, attention)
            row["rel_err_vs_naive"] = rel_err(got)
            row0[name] = got[0, :n0].clone()
            results[name] = row

        with mock.patch("dflash.model.target.right_padded", lambda m: False):
            early_stop("early stop, mask")  # transformers' forward, its 4-D mask
        early_stop("early stop, no mask, written out, eager (compile.target off)")
        feats.compile_layers()  # one graph for every layer; first_s is its compile
        early_stop("early stop, no mask, written out, compiled (production)")
        del expected
        # bf16 noise yardstick: row 0 alone (no padding, no mask) through the target in fp32.
        feats.float()
        with torch.no_grad():
            ref = feats(ids[:1, :n0], compiled=False)[0].double()
        for name, got in row0.items():
            err = (got.double() - ref).norm() / ref.norm()
            results[name]["rel_err_row0_vs_fp32"] = round(err.item(), 5)
        if self.args.profile:
            self.profile("target", lambda: feats(ids, attention))
        base = results["naive full forward + logits, mask"]["s"]
        for r in results.values():
            r["speedup_vs_naive"] = round(base / r["s"], 3)
        self.target_times = {k: v["s"] for k, v in results.items()}
        self.save(
            "target_features",
            {"batch": [self.pipe_batch, L], "tokens": tokens, "layers_kept": kept, "rows": results},
        )

    def target_row(self, t, info, lengths, layers, head, tokens):
        L = self.args.length
        useful = self.target_flops(lengths, layers, head)
        padded = self.target_flops([L] * len(lengths), layers, head)
        return {
            "s": round(t, 4),
            "tokens_per_s": round(tokens / t),
            "useful_tflops": round(useful / t / 1e12, 1),
            "padded_tflops": round(padded / t / 1e12, 1),
            # the padded batch's FLOPs at the measured matmul rate, over the measured time
            "roofline_frac": round(padded / self.matmul_rate / t, 3),
            "first_s": round(info["first_s"], 2),
            "peak_gb_above_weights": info["peak_gb"],
        }

    # ---- 3. CE alone ---------------------------------------------------------------------

    def ce_section(self):
        from dflash.model.lm_loss import checkpointed_lm_loss, chunked_lm_loss

        T = self.args.anchors[0] * self.dcfg.block_size * self.micro_batch
        g = torch.Generator(device=self.device).manual_seed(2)
        h = torch.randn(T, self.dcfg.hidden_size, device=self.device, generator=g)
        h.requires_grad_(True)
        labels = torch.randint(0, self.dcfg.vocab_size, (T,), device=self.device, generator=g)
        weights = torch.rand(T, device=self.device, generator=g)
        variants = {"full logits": (full_lm_loss, None)}
        variants["checkpointed chunks 2048"] = (checkpointed_lm_loss, 2048)
        variants["fused chunks 1024, eager"] = (chunked_lm_loss, 1024)
        compiled = functools.partial(chunked_lm_loss, compiled=self.cuda)
        for c in self.args.ce_chunks:
            variants[f"fused chunks {c}, compiled"] = (compiled, c)
        results, grads = {}, {}
        for name, (fn, chunk) in variants.items():

            def run(fn=fn, chunk=chunk):
                h.grad = None
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
                    total, _ = fn(h, self.head, labels, weights, chunk)
                (total / weights.sum()).backward()
                return total

            try:
                total = run()
                grads[name] = h.grad.float().clone()
                h.grad = None
                base = self.reset_peak()
                t, info = self.timed(run, 0, 3 if self.cuda else 1)
                results[name] = {"ms": round(t * 1e3, 2), "peak_gb": self.peak_gb(base)}
                results[name]["loss"] = round(total.item() / weights.sum().item(), 5)
            except torch.OutOfMemoryError as e:
                results[name] = {"error": f"OOM {str(e)[:100]}"}
            h.grad = None
        ref = grads.get("full logits")
        full = results.get("full logits", {})
        for name, r in results.items():
            if ref is not None and name in grads:
                r["grad_rel_err_vs_full"] = round(
                    ((grads[name] - ref).norm() / ref.norm()).item(), 5
                )
            if full.get("peak_gb") and r.get("peak_gb") is not None:
                r["peak_frac_of_full"] = round(r["peak_gb"] / full["peak_gb"], 3)
                r["speedup_vs_full"] = round(full["ms"] / r["ms"], 3)
        self.save("lm_head_ce", {"tokens": T, "vocab": self.dcfg.vocab_size, "rows": results})

    # ---- 4. drafter step -----------------------------------------------------------------

    def start_target_save(self):
        """Write the benchmarked target (its bf16 weights as they were before the fp32 check) for
        the pipeline, in a thread while the first drafter compile runs: nothing is timed then,
        and the thread is joined before anything is."""
        from safetensors.torch import save_file

        def write():
            t0 = time.perf_counter()
            try:
                out = self.work / "target"
                out.mkdir(parents=True, exist_ok=True)
                self.target_cfg.save_pretrained(out)
                state, seen = {}, set()
                for name, tensor in self.target_state.items():
                    if tensor.data_ptr() in seen:  # a tied head: loaded from the embedding
                        continue
                    seen.add(tensor.data_ptr())
                    state[name] = tensor.detach().to("cpu").contiguous()
                save_file(state, out / "model.safetensors", metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001  (re-raised by join_target_save)
                self.save_error = e
            self.report["target_save_s"] = round(time.perf_counter() - t0, 1)

        self.save_error = None
        self.save_thread = threading.Thread(target=write, daemon=True)
        self.save_thread.start()

    def join_target_save(self):
        if getattr(self, "save_thread", None) is not None:
            t0 = time.perf_counter()
            self.save_thread.join()
            self.report["target_save_wait_s"] = round(time.perf_counter() - t0, 1)
            self.save_thread = None
            self.target_state = None
            if self.save_error is not None:
                raise self.save_error

    def drafter_section(self):
        from dflash.model.drafter import Drafter

        if self.pipeline_topologies and self.target_state is not None:
            self.start_target_save()

        torch.manual_seed(0)
        with torch.device(self.device):  # fp32 master weights, as in training
            drafter = Drafter(self.dcfg)
        self.step_times, out = {}, {}
        for anchors, batch in self.cases:
            key = f"{anchors} anchors, {batch}x{self.args.length}"
            out[key] = self.drafter_case(drafter, anchors, batch)
            self.save("drafter_step", out)
        self.reset_peak()

    def drafter_case(self, drafter, anchors: int, batch: int) -> dict:
        from drafter_step import useful_flops

        from dflash.model.lm_loss import checkpointed_lm_loss
        from dflash.model.objective import default_gamma, dflash_loss, sample_anchors
        from dflash.model.step import TrainStep, resolve_attention

        cfg = self.dcfg
        gamma = default_gamma(cfg.block_size)
        attention = resolve_attention("auto", self.device)
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        ids, loss_mask, _, lengths = self.rows(batch, seed=3)
        g = torch.Generator(device=self.device).manual_seed(4)
        feats = torch.randn(
            batch, self.args.length, width, device=self.device, generator=g, dtype=self.dtype
        )
        # The anchors dflash_loss will draw (same mask, same seed): the useful FLOPs.
        a, v = sample_anchors(loss_mask, anchors, torch.Generator().manual_seed(5))
        flops = 0
        for i, n in enumerate(lengths):
            nv = int(v[i].sum())
            mean_anchor = a[i][v[i]].float().mean().item() if nv else 0.0
            flops += useful_flops(cfg, n, nv, mean_anchor)
        step = TrainStep(
            drafter,
            self.embed,
            self.head,
            max_anchors=anchors,
            gamma=gamma,
            attention=attention,
            compile=self.cuda,
        )

        def autocast():
            return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda)

        def naive_loss():
            with autocast():
                return dflash_loss(
                    drafter, self.embed, self.head, feats, ids, loss_mask,
                    torch.Generator().manual_seed(5), anchors, gamma, backend="sdpa",
                    lm_loss=full_lm_loss,
                )  # fmt: skip

        def checkpointed_loss():
            with autocast():
                return dflash_loss(
                    step.model, self.embed, self.head, feats, ids, loss_mask,
                    torch.Generator().manual_seed(5), anchors, gamma, backend=attention,
                    compiled_flex=step.compile and attention == "flex",
                    lm_loss=checkpointed_lm_loss,
                )  # fmt: skip

        def fused_eager_loss():
            with autocast():
                return dflash_loss(
                    step.model, self.embed, self.head, feats, ids, loss_mask,
                    torch.Generator().manual_seed(5), anchors, gamma, backend=attention,
                    compiled_flex=step.compile and attention == "flex", compiled_ce=False,
                )  # fmt: skip

        def production_loss(step=step):  # exactly what training runs
            return step.loss(feats, ids, loss_mask, torch.Generator().manual_seed(5), host=False)

        def other_step(**kw):  # the production step with one setting changed
            other = TrainStep(
                drafter, self.embed, self.head, max_anchors=anchors, gamma=gamma,
                attention=attention, compile=self.cuda, **kw,
            )  # fmt: skip
            return functools.partial(production_loss, step=other)

        naive_name = "naive: eager, SDPA dense mask, full logits, foreach AdamW"
        variants = {
            "compiled layers + flex, checkpointed CE, fused AdamW": (checkpointed_loss, "fused"),
            "compiled layers + flex, fused CE eager, fused AdamW": (fused_eager_loss, "fused"),
        }
        if self.args.before:  # a cold compile of its own: minutes at Qwen3-8B shapes
            variants[BEFORE] = (other_step(compile_scope="model"), "fused")
        variants[PRODUCTION] = (production_loss, "fused")
        for tokens in self.args.step_ce_chunks:
            variants[f"production, CE chunks {tokens}"] = (other_step(ce_chunk=tokens), "fused")
        if anchors != self.args.anchors[0]:  # the CE comparisons once are enough
            del variants["compiled layers + flex, fused CE eager, fused AdamW"]
            for tokens in self.args.step_ce_chunks:
                del variants[f"production, CE chunks {tokens}"]
        # The compiled variants first: the first compile overlaps the target save (above).
        variants[naive_name] = (naive_loss, "foreach")
        rows = {}
        for name, (loss_fn, optim) in variants.items():
            try:
                profile_name = f"step-{anchors}" if name == PRODUCTION else None
                rows[name] = self.time_step(
                    drafter, loss_fn, optim, flops, lengths, int(v.sum()), profile_name
                )
            except torch.OutOfMemoryError as e:
                rows[name] = {"error": f"OOM {str(e)[:100]}"}
            drafter.zero_grad(set_to_none=True)
            self.reset_peak()
        rows = {naive_name: rows.pop(naive_name)} | rows  # naive first in the table
        naive = rows[naive_name].get("step_s")
        for r in rows.values():
            if naive and "step_s" in r:
                r["speedup_vs_naive"] = round(naive / r["step_s"], 3)
        self.step_times[anchors] = {k: r.get("step_s") for k, r in rows.items()}
        return {
            "anchors": anchors,
            "batch": [batch, self.args.length],
            "context_tokens": sum(lengths),
            "real_blocks": int(v.sum()),
            "useful_tflop": round(flops / 1e12, 2),
            "rows": rows,
        }

    def phase_ms(self, loss_fn, clip_and_step) -> dict:
        """Device milliseconds of one step's phases (CUDA events): the forward (the fused CE's
        gradient included), the backward, clip + AdamW; and the host's wall time for the step,
        beside their sum: a gap means the device waited for the host."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.sync()
        t0 = time.perf_counter()
        marks[0].record()
        loss, _ = loss_fn()
        marks[1].record()
        loss.backward()
        marks[2].record()
        clip_and_step()
        marks[3].record()
        self.sync()
        wall = time.perf_counter() - t0
        names = ("forward", "backward", "clip_and_adamw")
        out = {n: round(marks[i].elapsed_time(marks[i + 1]), 2) for i, n in enumerate(names)}
        return out | {"wall": round(wall * 1e3, 2)}

    def time_step(
        self, drafter, loss_fn, optim: str, flops, lengths, blocks: int, profile_name=None
    ) -> dict:
        """One optimizer step per batch: loss, backward, clip, AdamW; median of `--steps`.
        optim: "foreach" or "fused" AdamW, after torch's clip as training runs it."""
        params = list(drafter.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=optim == "fused")

        def clip_and_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        def train_step():
            loss, m = loss_fn()
            loss.backward()
            clip_and_step()
            opt.zero_grad(set_to_none=True)
            return m

        t0 = time.perf_counter()
        train_step()  # compiles; creates the optimizer state
        self.sync()
        first = time.perf_counter() - t0
        self.join_target_save()
        base = self.reset_peak()
        t, info = self.timed(train_step, 1, self.args.steps)
        peak = self.peak_gb()  # absolute: weights, grads, Adam state, activations
        loss, _ = loss_fn()  # the optimizer alone, on one step's gradients
        loss.backward()
        t_opt, _ = self.timed(clip_and_step, 1, 2)
        opt.zero_grad(set_to_none=True)
        phases = self.phase_ms(loss_fn, clip_and_step) if self.cuda else None
        opt.zero_grad(set_to_none=True)
        if profile_name and self.args.profile:
            self.profile(profile_name, train_step)
        return {
            "step_s": round(t, 4),
            "optimizer_s": round(t_opt, 4),
            "phase_ms": phases,
            "context_tokens_per_s": round(sum(lengths) / t),
            "block_tokens_per_s": round(blocks * self.dcfg.block_size / t),
            "tflops": round(flops / t / 1e12, 1),
            "mfu": round(flops / t / PEAK_BF16, 4),
            "frac_of_matmul": round(flops / t / self.matmul_rate, 4),
            "peak_gb": peak,
            "base_gb": round(base / 1e9, 2) if self.cuda else None,
            "first_s": round(first, 2),
            "times_s": info["times_s"],
        }

    # ---- 5. warm start -------------------------------------------------------------------

    def warm_section(self):
        """A fresh process that finds this run's compile cache, as a training process finds the
        warmup rule's: its seconds to import what training imports, then the warmup rule's own
        code (`warm_shapes`) on the last drafter case's shape, each graph's first call, with
        dynamo's compile-time split and the cache hits: what still compiles warm, and for how
        long. With `--before`, also for the whole drafter compiled (`compile.scope: model`)."""
        import subprocess

        results = {}
        for scope in ("model", "layers") if self.args.before else ("layers",):
            spec = {
                "target_config": str(self.cfg_dir),
                "cache": str(self.work / "compile-cache"),
                "layers": self.args.layers,
                "scope": scope,
                "anchors": self.cases[-1][0],  # the last drafter case's graphs are in the cache
                "shapes": [[self.cases[-1][1], self.args.length]],
                "mask_token_id": self.target_cfg.vocab_size - 1,
                "device": str(self.device),
                "profile": str(Path(self.args.out).parent / f"warm-start-{scope}-cprofile.txt"),
            }
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, __file__, "--warm-child", json.dumps(spec)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                results[scope] = {"error": done.stderr[-3000:]}
                continue
            results[scope] = json.loads(done.stdout.strip().splitlines()[-1])
            results[scope]["command_wall_s"] = round(time.perf_counter() - t0, 1)
        # the production scope's numbers at the top level (the goals table reads them there)
        self.save("warm_start", results.pop("layers") | {"other_scopes": results})

    # ---- 6. pipeline ---------------------------------------------------------------------

    def pipeline_section(self):
        import pipeline
        import yaml

        from dflash.config import validate

        self.join_target_save()
        config = yaml.safe_load((REPO / "config/config.yaml").read_text())
        L = self.args.length
        over = {
            "drafter": {"num_layers": self.args.layers, "max_anchors": self.args.anchors[-1]},
            "data": {
                "token_budget": self.pipe_batch * L,
                "max_batch_size": 16,
                "buckets": [L],
                "max_length": L,
            },
            "compile": {"enabled": self.cuda},
        }
        for section, values in over.items():
            config[section] = config.get(section, {}) | values
        config["target"]["mask_token_id"] = self.target_cfg.vocab_size - 1
        config["train"] |= {"checkpoint_every": 10**9, "keep_checkpoints": 1}
        config = validate(config, "bench config")
        args = argparse.Namespace(target=self.work / "target", data=self.work / "rows.parquet")
        if not args.target.exists():  # the target section did not run: a random one
            pipeline.synthetic_target(self.cfg_dir, args.target)
        pipeline.synthetic_rows(
            args.data, self.args.rows, L, self.target_cfg.vocab_size, min_length=int(0.6 * L) + 1
        )
        # The naive colocated estimate: one GPU computes the naive features, then the naive step.
        anchors = self.args.anchors[-1]
        tokens = self.pipe_tokens
        times = self.step_times.get(anchors, {})
        naive_step = times.get("naive: eager, SDPA dense mask, full logits, foreach AdamW")
        prod_step = times.get(PRODUCTION)
        t_naive = self.target_times.get("naive full forward + logits, mask")
        t_prod = self.target_times.get("early stop, no mask, written out, compiled (production)")
        est = {
            "naive_colocated_tokens_per_s": round(tokens / (t_naive + naive_step))
            if naive_step and t_naive
            else None,
            "production_colocated_tokens_per_s": round(tokens / (t_prod + prod_step))
            if prod_step and t_prod
            else None,
            "production_target_alone_tokens_per_s": round(tokens / t_prod) if t_prod else None,
            "production_drafter_alone_tokens_per_s": round(tokens / prod_step)
            if prod_step
            else None,
        }
        results = {"estimate_from_components": est, "runs": {}}
        for spec in self.pipeline_topologies:
            targets, drafters = map(int, spec.split("+"))
            elapsed = time.perf_counter() - self.started
            if self.args.budget_s and elapsed > self.args.budget_s - self.args.pipeline_s:
                results["runs"][spec] = {
                    "error": f"skipped: {elapsed:.0f} s elapsed, a run takes ~{self.args.pipeline_s}"
                    f" s, the budget is {self.args.budget_s} s"
                }
                continue
            t0 = time.perf_counter()
            try:
                s = pipeline.run_topology(args, config, targets, drafters, self.work)
            except SystemExit as e:  # run_topology exits with the failed run's stderr
                results["runs"][spec] = {"error": str(e)[-3000:]}
                self.save("pipeline", results)
                continue
            finally:
                log = self.work / spec / "stderr.log"
                if log.exists():
                    name = f"pipeline-{spec.replace('+', 'p')}.log"
                    (Path(self.args.out).parent / name).write_text(log.read_text()[-200_000:])
            s["command_wall_s"] = round(time.perf_counter() - t0, 1)
            world = targets + drafters
            s["tokens_per_s_per_gpu"] = round(s["tokens_per_s"] / world)
            if est["naive_colocated_tokens_per_s"]:
                s["per_gpu_vs_naive_colocated"] = round(
                    s["tokens_per_s_per_gpu"] / est["naive_colocated_tokens_per_s"], 3
                )
            s["per_gpu_vs_specforge"] = round(s["tokens_per_s_per_gpu"] / SPECFORGE_PER_GPU, 2)
            results["runs"][spec] = {
                k: s[k]
                for k in (
                    "tokens_per_s",
                    "tokens_per_s_per_gpu",
                    "per_gpu_vs_naive_colocated",
                    "per_gpu_vs_specforge",
                    "target_capacity_tokens_per_s",
                    "drafter_capacity_tokens_per_s",
                    "mean_queue_depth",
                    "time_split",
                    "peak_memory_gb",
                    "startup_s",
                    "startup_split_s",
                    "compile_s",
                    "steps",
                    "verdict",
                    "command_wall_s",
                )
                if k in s
            }
            self.save("pipeline", results)
        self.save("pipeline", results)

    # ---- the whole run -------------------------------------------------------------------

    def run(self):
        from transformers import AutoConfig

        from dflash.model.drafter import DrafterConfig
        from dflash.train.warmup import use_cache

        a = self.args
        self.work = Path(tempfile.mkdtemp(prefix="dflash-gpu-bench-"))
        use_cache(self.work / "compile-cache")  # one cache: the pipeline reuses our compiles
        if a.small:
            cfg_dir = self.work / "tiny-config"
            cfg_dir.mkdir()
            (cfg_dir / "config.json").write_text(json.dumps(TINY_TARGET))
        else:
            cfg_dir = Path(a.target_config)
        self.cfg_dir = cfg_dir
        self.target_cfg = AutoConfig.from_pretrained(cfg_dir)
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.dcfg = DrafterConfig.for_target(
            self.target_cfg, a.layers, 16, self.target_cfg.vocab_size - 1
        )
        self.micro_batch = a.micro_batch
        self.pipe_batch = a.pipe_batch
        # (anchors, batch): the first at --micro-batch, the second (the pipeline's) at --pipe-batch
        self.cases = list(zip(a.anchors, (a.micro_batch, a.pipe_batch), strict=False))
        gpus = torch.cuda.device_count() if self.cuda else 0
        if a.no_pipeline:
            self.pipeline_topologies = []
        elif a.topologies:
            self.pipeline_topologies = [t for t in a.topologies.split(",") if t]
        else:
            self.pipeline_topologies = ["1+1"] if gpus >= 2 else ["0+1"]
        self.report |= {
            "command": " ".join(sys.argv),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "gpus": gpus,
            "target": str(cfg_dir),
            "length": a.length,
            "lengths": f"uniform in ({int(0.6 * a.length)}, {a.length}], one bucket",
            "micro_batch": self.micro_batch,
            "pipe_batch": self.pipe_batch,
            "drafter": self.dcfg.to_hf(),
        }
        sections = a.sections
        if "pipeline" not in sections:
            self.pipeline_topologies = []
        self.ceilings()
        if "target" in sections:
            self.target_section()
        else:  # the drafter's frozen embedding and head, random
            self.target_times, self.target_state = {}, None
            g = torch.Generator(device=self.device).manual_seed(1)
            shape = (self.target_cfg.vocab_size, self.target_cfg.hidden_size)
            weight = torch.randn(shape, device=self.device, generator=g, dtype=self.dtype)
            self.embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)
            self.head = weight.clone()
        _, _, _, lengths = self.rows(self.pipe_batch, seed=1)
        self.pipe_tokens = sum(lengths)
        if "ce" in sections:
            self.ce_section()
        self.step_times = {}
        if "drafter" in sections:
            self.drafter_section()
        del self.embed, self.head
        self.reset_peak()
        if "warm" in sections:
            self.warm_section()
        if self.pipeline_topologies:
            self.pipeline_section()
        self.save("goals", goals(self.report))
        self.report["wall_s"] = round(time.perf_counter() - self.started, 1)
        self.save("done", {"wall_s": self.report["wall_s"]})
        print(table(self.report))


def warm_child(spec: dict) -> None:
    """The warm-start measurement (`Bench.warm_section`), in its own process; prints JSON."""
    from dflash.host import process_age_s

    marks = {"interpreter_and_torch": process_age_s()}
    import dflash.train.loop  # noqa: F401  (everything a training process imports)

    marks["training_imports"] = process_age_s()
    from warmup_gpu import warm_config

    from dflash.model.drafter import Drafter, DrafterConfig
    from dflash.train.warmup import use_cache, warm_shapes

    use_cache(Path(spec["cache"]))
    config = warm_config(
        spec["layers"], spec["anchors"], spec["mask_token_id"], spec["device"], spec["scope"]
    )
    shapes = [tuple(x) for x in spec["shapes"]]
    import cProfile
    import io
    import pstats

    t0 = time.perf_counter()
    with cProfile.Profile() as prof:  # where a warm start's seconds go, by Python function
        records, setup = warm_shapes(Path(spec["target_config"]), config, shapes, steps=1)
    warm_s = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    Path(spec["profile"]).write_text(text.getvalue())
    marks["warm_shapes"] = process_age_s()
    # the drafter's construction alone (part of warm_shapes above): fp32 init on the host
    from transformers import AutoConfig

    cfg = DrafterConfig.for_target(
        AutoConfig.from_pretrained(spec["target_config"]), spec["layers"], 16, 0
    )
    t1 = time.perf_counter()
    Drafter(cfg)
    init_s = time.perf_counter() - t1  # the host, as training drew it before
    counters = torch._dynamo.utils.counters
    hits = {
        f"{group}.{name}": n
        for group in ("inductor", "aot_autograd")
        for name, n in counters[group].items()
        if "cache" in name
    }
    print(
        json.dumps(
            {
                "process_age_s": marks,
                "warm_shapes_s": round(warm_s, 2),
                "drafter_host_init_s": round(init_s, 2),
                "shapes": records,
                **setup,
                "cache_counters": hits,
                "compile_times": torch._dynamo.utils.compile_times(repr="str"),
            }
        )
    )


KERNEL_KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("flex attention", ("flex_attention",)),
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


def full_lm_loss(hidden, head_weight, labels, weights, chunk_tokens=None):
    """The naive CE: all logits at once (as the reference implementations compute it)."""
    logits = (hidden @ head_weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


PRODUCTION = "production: compiled layers + flex, fused CE compiled, fused AdamW"
BEFORE = "before: the whole drafter compiled"  # the previous production step
PIPELINE_BEFORE = 13150  # tokens/s per GPU, 1 + 1 on two H200 (issue 7's run)
GOALS = {  # issue 17
    "mfu": ("drafter step at the first anchors: MFU vs 989 TFLOP/s", 0.62),
    "roofline": ("target features (production): fraction of the roofline", 0.80),
    "warm_start": ("warm start: seconds from process start to the first step", 10.0),
    "pipeline": ("pipeline 1 + 1: tokens/s per GPU (1.25x 13,150)", 1.25 * PIPELINE_BEFORE),
}


def goals(report: dict) -> dict:
    """Issue 17's goals, each with this run's value and whether it is met (None: not measured)."""
    s = report["sections"]
    values = {}
    steps = list(s.get("drafter_step", {}).values())
    if steps:
        values["mfu"] = steps[0]["rows"].get(PRODUCTION, {}).get("mfu")
    target = s.get("target_features", {}).get("rows", {})
    row = next((r for n, r in target.items() if "(production)" in n), {})
    values["roofline"] = row.get("roofline_frac")
    # a real `dflash train` (the pipeline's runs) when there is one, else the warm-start child
    runs = [r for r in s.get("pipeline", {}).get("runs", {}).values() if r.get("startup_s")]
    warm = s.get("warm_start", {})
    if runs:
        values["warm_start"] = max(r["startup_s"] for r in runs)
    elif "process_age_s" in warm:
        values["warm_start"] = warm["process_age_s"]["warm_shapes"]
    run = s.get("pipeline", {}).get("runs", {}).get("1+1", {})
    values["pipeline"] = run.get("tokens_per_s_per_gpu")
    out = {}
    for key, (what, goal) in GOALS.items():
        v = values.get(key)
        lower_is_better = key == "warm_start"
        met = None if v is None else (v <= goal if lower_is_better else v >= goal)
        out[key] = {"goal": what, "target": goal, "value": v, "met": met}
    return out


def table(report: dict) -> str:
    s = report["sections"]
    lines = [
        f"== bench/gpu.py: {report['gpu']} x{report['gpus']}, torch {report['torch']}, "
        f"whole command {report['wall_s']} s; rows {report['lengths']} =="
    ]
    c = s["ceilings"]
    lines.append(
        f"ceilings: bf16 matmul {c['matmul_bf16_tflops']} TFLOP/s, copy {c['copy_tb_s']} TB/s"
    )
    lines.append("")
    lines.append("drafter step (fwd + bwd + clip + AdamW); MFU vs 989 TFLOP/s")
    lines.append(
        f"{'shape':24} {'variant':52} {'step s':>7} {'ctx tok/s':>9} {'TFLOP/s':>7} "
        f"{'MFU':>6} {'peak GB':>7} {'x naive':>7}"
    )
    for key, d in s.get("drafter_step", {}).items():
        for name, r in d["rows"].items():
            if "error" in r:
                lines.append(f"{key:24} {name:52} {r['error']}")
                continue
            lines.append(
                f"{key:24} {name:52} {r['step_s']:7.4f} {r['context_tokens_per_s']:9d} "
                f"{r['tflops']:7.1f} {100 * r['mfu']:5.1f}% {r['peak_gb'] or 0:7.1f} "
                f"{r['speedup_vs_naive']:7.2f}"
            )
    lines.append("")
    ce = s.get("lm_head_ce", {})
    lines.append(
        f"LM-head CE alone, {ce.get('tokens')} tokens x vocab {ce.get('vocab')}, fwd + bwd"
    )
    lines.append(
        f"{'variant':28} {'ms':>8} {'peak GB':>8} {'/ full':>7} {'x full':>7} {'grad err':>9}"
    )
    for name, r in ce.get("rows", {}).items():
        if "error" in r:
            lines.append(f"{name:28} {r['error']}")
            continue
        lines.append(
            f"{name:28} {r['ms']:8.2f} {r['peak_gb'] or 0:8.2f} {r.get('peak_frac_of_full', 0):7.3f} "
            f"{r.get('speedup_vs_full', 0):7.2f} {r.get('grad_rel_err_vs_full', 0):9.1e}"
        )
    lines.append("")
    t = s.get("target_features", {})
    lines.append(f"target features, batch {t.get('batch')}, {t.get('tokens')} real tokens")
    lines.append(
        f"{'variant':62} {'s':>7} {'tok/s':>7} {'TFLOP/s':>8} {'roofline':>8} {'x naive':>7} "
        f"{'err':>8} {'err fp32':>8}"
    )
    for name, r in t.get("rows", {}).items():
        lines.append(
            f"{name:62} {r['s']:7.4f} {r['tokens_per_s']:7d} {r['padded_tflops']:8.1f} "
            f"{100 * r['roofline_frac']:7.1f}% {r['speedup_vs_naive']:7.2f} "
            f"{r.get('rel_err_vs_naive', 0):8.1e} {r.get('rel_err_row0_vs_fp32', 0):8.1e}"
        )
    w = s.get("warm_start")
    if w and "process_age_s" in w:
        lines.append("")
        lines.append(
            f"warm start (a fresh process, this run's cache): process age {w['process_age_s']}; "
            f"first calls {[(r['first_step_s'], r.get('target_layer_s')) for r in w['shapes']]}; "
            f"drafter host init {w['drafter_host_init_s']} s; cache {w['cache_counters']}"
        )
    for name, prof in report.get("profiles", {}).items():
        lines.append(f"profile {name}: device ms {prof['device_ms']}")
    p = s.get("pipeline")
    if p:
        lines.append("")
        est = p["estimate_from_components"]
        lines.append(
            "colocated estimate from the components above (tokens / (features + step)): naive "
            f"{est['naive_colocated_tokens_per_s']}, production "
            f"{est['production_colocated_tokens_per_s']} tok/s per GPU"
        )
        lines.append(
            f"{'topology':9} {'tok/s':>8} {'per GPU':>8} {'x naive':>7} {'x SpecForge':>11} "
            f"{'target cap':>10} {'drafter cap':>11} {'peak GB':>7}  verdict"
        )
        for spec, r in p["runs"].items():
            if "error" in r:
                lines.append(f"{spec:9} failed: {r['error'][-300:]}")
                continue
            lines.append(
                f"{spec:9} {r['tokens_per_s']:8.0f} {r['tokens_per_s_per_gpu']:8d} "
                f"{r.get('per_gpu_vs_naive_colocated', 0):7.2f} {r['per_gpu_vs_specforge']:11.2f} "
                f"{r.get('target_capacity_tokens_per_s', 0) or 0:10.0f} "
                f"{r['drafter_capacity_tokens_per_s']:11.0f} {r['peak_memory_gb']:7.1f}  "
                f"{r['verdict'][:90]}"
            )
            if r.get("startup_s") is not None:
                lines.append(
                    f"{'':9} first step {r['startup_s']} s after the process started: "
                    f"{r.get('startup_split_s')}"
                )
    lines.append("")
    lines.append("issue 17's goals")
    for g in s.get("goals", {}).values():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        lines.append(f"{g['goal']:62} goal {g['target']:>8} this run {g['value']!s:>8}  {verdict}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-config", default=str(HERE / "qwen3-8b-config"))
    p.add_argument("--length", type=int, default=2560, help="bucket length L")
    p.add_argument("--anchors", default="512,256", help="micro-batch anchors, pipeline anchors")
    p.add_argument("--micro-batch", type=int, default=2, help="rows per step at the 1st anchors")
    p.add_argument("--pipe-batch", type=int, default=4, help="rows per batch in the pipeline")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed drafter steps per variant")
    p.add_argument("--ce-chunks", default="1024", help="compiled fused CE chunks")
    p.add_argument(
        "--step-ce-chunks", default="", help="other CE chunk sizes to time in the production step"
    )
    p.add_argument("--rows", type=int, default=128, help="pipeline rows (batches x pipe-batch)")
    p.add_argument("--topologies", help="default: 1+1 with 2+ GPUs, else 0+1")
    p.add_argument("--no-pipeline", action="store_true")
    p.add_argument(
        "--sections",
        default="target,ce,drafter,warm,pipeline",
        help="which sections to run (the ceilings always run); without target, the drafter's "
        "embedding and head are random",
    )
    p.add_argument("--warm-child", help=argparse.SUPPRESS)  # JSON: one warm-start measurement
    p.add_argument("--budget-s", type=float, help="skip a pipeline run that would end past this")
    p.add_argument("--pipeline-s", type=float, default=180, help="one pipeline run's seconds")
    p.add_argument("--profile", action="store_true", help="kernel tables of one step each")
    p.add_argument(
        "--before",
        action="store_true",
        help="also time the previous production step (the whole drafter compiled): a cold "
        "compile of its own",
    )
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU logic check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    a = p.parse_args()
    if a.warm_child:
        return warm_child(json.loads(a.warm_child))
    a.sections = set(a.sections.split(","))
    a.anchors = [int(x) for x in a.anchors.split(",")]
    a.ce_chunks = [int(x) for x in a.ce_chunks.split(",")]
    a.step_ce_chunks = [int(x) for x in a.step_ce_chunks.split(",") if x]
    if a.small:
        a.length, a.anchors, a.layers, a.steps, a.rows = 128, [16, 8], 2, 2, 24
        a.ce_chunks = [64, 256]
    Bench(a).run()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
