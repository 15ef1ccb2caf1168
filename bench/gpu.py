"""GPU performance of DFlash training at real shapes, in one command (issues 7 and 17).

    python bench/gpu.py [--out results.json]          # on the GPU machine, repo root on PYTHONPATH
    python bench/gpu.py --sections drafter,warm --anchors 512 --profile   # a part of it
    python bench/gpu.py --small --device cpu           # tiny shapes: checks the script's logic

On whatever GPUs it finds, with random-init models of real shapes (a Qwen3-8B-shaped target from
config/models/qwen3-8b and its 5-layer B=16 drafter) and rows whose lengths are uniform in
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

Each section is a module of its own beside this one: `gpu_base` (helpers, the ceilings, the
rows), `gpu_target`, `gpu_ce`, `gpu_drafter`, `gpu_warm`, `gpu_pipeline`, and `gpu_goals` (the
goals and the table); this file puts them together and reads the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import torch  # noqa: E402
from gpu_base import BenchBase  # noqa: E402
from gpu_ce import CESection  # noqa: E402
from gpu_drafter import DrafterSection  # noqa: E402
from gpu_goals import goals, table  # noqa: E402
from gpu_pipeline import PipelineSection  # noqa: E402
from gpu_target import TargetSection  # noqa: E402
from gpu_warm import WarmSection, warm_child  # noqa: E402

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


class Bench(BenchBase, TargetSection, CESection, DrafterSection, WarmSection, PipelineSection):
    """The whole run: the ceilings, then the sections asked for, in order; the goals last."""

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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-config", default=str(HERE.parent / "config/models/qwen3-8b"))
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
