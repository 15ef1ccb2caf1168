"""`bench/gpu.py` section 3, the LM-head CE alone: full logits against checkpointed chunks against
the fused chunked CE (eager and compiled); peak memory above its inputs, time, gradient error."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def full_lm_loss(hidden, head_weight, labels, weights, chunk_tokens=None):
    """The naive CE: all logits at once (as the reference implementations compute it)."""
    logits = (hidden @ head_weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


class CESection:
    """Section 3 of `Bench`: the LM-head CE alone."""

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
