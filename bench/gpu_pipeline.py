"""`bench/gpu.py` section 6, the pipeline: `dflash train` under torchrun as the rule runs it
(`bench/pipeline.py`) on the benchmarked target's weights (written out while the first drafter
compile runs); tokens/s per GPU against a colocated naive estimate from the sections before."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from gpu_drafter import PRODUCTION

REPO = Path(__file__).resolve().parents[1]
SPECFORGE_PER_GPU = 3400  # SpecForge's reported tokens/s per GPU at 256 anchors (issue 7)


class PipelineSection:
    """Section 6 of `Bench`: `dflash train` end to end, and the target it trains against."""

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
