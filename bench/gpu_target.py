"""`bench/gpu.py` section 2, target features: the naive full forward (all layers, LM head, every
hidden state) against the early stop (`TargetFeatures`) with and without the padding mask, its
layers written out, eager and compiled; tokens/s and the fraction of the forward's roofline."""

from __future__ import annotations

from unittest import mock

import torch


class TargetSection:
    """Section 2 of `Bench`: the target's features, naive against production."""

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
