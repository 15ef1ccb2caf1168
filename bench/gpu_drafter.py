"""`bench/gpu.py` section 4, the drafter training step (forward, backward, grad clip, AdamW) per
anchor count: the naive reference against the compiled variants and the production `TrainStep`;
step time, tokens/s, TFLOP/s, MFU, peak memory, the device time of each phase and, with
`--profile`, kernel time by kind."""

from __future__ import annotations

import functools
import time

import torch
from gpu_ce import full_lm_loss

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16, datasheet
PRODUCTION = "production: compiled layers + flex, fused CE compiled, fused AdamW"
BEFORE = "before: the whole drafter compiled"  # the previous production step


class DrafterSection:
    """Section 4 of `Bench`: the drafter's training step, variant by variant."""

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
