"""The measured rates `dflash plan` reads: every entry names its source, date, machine and shapes.

An entry is one measurement of one stage on one GPU kind at one target shape (`target` names a
preset of `PRESETS`). `dflash plan` uses an entry as it is where the plan's shape, GPU kind and
workload equal the entry's ("measured"), and scales the nearest entry otherwise ("projected").
Entries of the plan's own (target, gpu) win over every other, so a new measurement is one more
line in `RATES`; order only breaks ties (earlier first).

To add one, copy an entry of the same stage and change `target`, `gpu`, `value`, `workload` and
the provenance (`source`, `date`, `machine`, `config`). A new preset's shape goes into `PRESETS`.

Stages and their `value`:
- regenerate: new tokens/s of the whole stage on one GPU; workload `batch` (rows per decode step),
  `prompt_tokens` and `new_tokens` (means per turn), `max_new_tokens` (the cache's reserve),
  `tiers` (prompt tiers the run used: each ends with a drain), `tokens` (its new tokens); optionally `row_prompt_tokens`
  and `row_new_tokens`, the same data's means per row (a conversation's turns together), which
  is what a plan's data are in;
- tokenize: tokens/s of the tokenize rule (CPU) beyond its `fixed_s` (0 if absent), measured on
  `tokens`; `num_proc`;
- warmup: seconds of the compile warmup for `shapes` bucket shapes at `anchors`; `later_s` per
  further shape;
- train: context tokens/s per GPU of `dflash train`, colocated 0 + 1; workload `length` and
  `prompt` (mean tokens per row, of which prompt), `anchors`, `drafter_layers`, `block_size`;
- features / drafter_step: the two halves of a training step alone (for T + D topologies):
  context tokens/s of the target's features, and of the drafter step; same workload keys;
- startup: seconds from the trainer's process start to its first step, compile cache warm;
- eval: seconds of eval_acceptance + eval_ddtree for `prompts` prompts of `new_tokens`; workload
  `target_tokens_per_s`, the target's own batch-1 decoding speed in that run; `fixed_s`, the
  part that does not grow with prompts or tokens (loading, graphs; 0 if absent).
"""

from __future__ import annotations

from dflash.plan.presets import GPUS, PRESETS  # noqa: F401  (read from here)

H200 = "one NVIDIA H200, torch 2.11.0+cu130"
RECIPE_END_TO_END = (
    "BENCHMARKS.md 2026-12-02 (last), the 5-layer recipe end to end; "
    "bench/results/2026-12-02-h200-5-layer-recipe-end-to-end.json"
)
PIPELINE_0P1 = (
    "BENCHMARKS.md 2026-12-02 (evening), Pipeline table; bench/results/"
    "2026-12-02-h200-gpu-bench-256-warm-start-pipeline-0p1.json"
)

REHEARSAL_8B = (
    "BENCHMARKS.md 2026-12-03, the 8B rehearsal; bench/results/2026-12-03-h200-rehearsal-8b.json"
)

REHEARSAL_8B_ONE_RUN = (
    "BENCHMARKS.md 2026-12-04, the 8B rehearsal in one run; "
    "bench/results/2026-12-04-h200-rehearsal-8b-one-run.json"
)

RATES = [
    # -- Qwen3-8B shapes (random weights) in the workflow: the 8B rehearsal, config/rehearsal-8b.yaml
    # (512 ShareGPT conversations, every turn, each answer 1,024 tokens: a random target never
    # stops). Earlier entries win ties, so these come before the benches' below.
    {
        "stage": "regenerate",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 5212,
        # per turn: new_tokens 1,069,384 over 1,045 turns; prompt_tokens from the run's own
        # kv_reads (each busy row's cache read per step: a mean of 1,413 tokens = the prompt +
        # half the answer, 512). Per row (what a plan's data are in): 2,089 new tokens
        # (1,069,384 / 512); 216 prompt tokens is an estimate (not measured by the run).
        # tiers: one engine for every prompt length (flex); steps 10,240: every answer ran to the
        # cap, so rows finished together, in 10 waves of 1,024 steps (1,045 turns fill 8.2)
        "workload": {
            "batch": 128,
            "prompt_tokens": 901,
            "new_tokens": 1023,
            "max_new_tokens": 1024,
            "tiers": 1,
            "tokens": 1069384,
            "row_prompt_tokens": 216,
            "row_new_tokens": 2089,
        },
        "source": f"{REHEARSAL_8B_ONE_RUN}, regenerate_train (1,069,384 new tokens in 205.18 s; "
        "2026-12-03's third run with five prompt tiers: 5,070 tokens/s)",
        "date": "2026-12-04",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml at e376606: static engine, flex attention (one "
        "engine, packed prefill), bf16",
    },
    {
        "stage": "train",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 16983,
        # length: 16,982.6 tokens/s x 0.4912 s a steady step (time_split) / 4 rows = 2,085
        # tokens a row after truncation at 2,560; prompt: the rows' 216 estimated, as above
        "workload": {
            "length": 2085,
            "prompt": 216,
            "anchors": 256,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": f"{REHEARSAL_8B_ONE_RUN}, train_summary.tokens_per_s (383 steady steps, "
        "96.7 % of the bench's 17,555; 2026-12-03's first run: 16,663)",
        "date": "2026-12-04",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: 0 + 1, batches of 4 x 2560, compiled",
    },
    {
        "stage": "checkpoint",
        "target": "qwen3-8b",
        "gpu": "h200",
        # GB/s of the copy to host that stalls the step (12.58 GB in 9.1, 8.9, 9.4 s); the
        # write and hash run beside training (19.5-23.5 s), the last one awaited at the end
        "value": 1.38,
        "workload": {"gb": 12.58, "write_gb_s": 0.58},
        "source": f"{REHEARSAL_8B_ONE_RUN}, train.log checkpoint lines (3 checkpoints)",
        "date": "2026-12-04",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: fp32 weights and AdamW moments of a 1.05B drafter",
    },
    {
        "stage": "rest",
        "target": "qwen3-8b",
        "gpu": "h200",
        # the rules outside the five stages, in the run's critical path: the target (draw,
        # write, hash 16.4 GB: 78 s, expand_dataset beside it) and record (hashes it again:
        # 24 s), the eval split's regeneration (86 s: on one GPU it holds the GPU first),
        # length_stats 7 s and report 2 s
        "value": 197,
        "workload": {
            "target_gb": 16.4,
            "target_s": 102,
            "eval_split_s": 86,
            "eval_rows": 8,
            "cpu_s": 9,
        },
        "source": f"{REHEARSAL_8B_ONE_RUN}, rule_seconds",
        "date": "2026-12-04",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: data.eval_rows 8, a random target drawn on the GPU",
    },
    {
        "stage": "warmup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 106,
        # the rule's wall (compile/warmup.json: 97.8 s, the first step 77.3 s); later_s: the
        # 2026-11-30 warmup entry's further shapes, as the bench entry below
        "workload": {"shapes": 1, "later_s": 32, "anchors": 256},
        "source": f"{REHEARSAL_8B_ONE_RUN}, rule_seconds warmup_compile (beside regeneration)",
        "date": "2026-12-04",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: buckets [2560], 256 anchors, batch 4",
    },
    {
        "stage": "startup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 31.2,
        "workload": {},
        "source": f"{REHEARSAL_8B_ONE_RUN}, train_summary.startup_s (imports 17.9, setup 5.4, "
        "compile 7.7)",
        "date": "2026-12-04",
        "machine": H200,
        "config": "dflash train 0 + 1, compile cache warm from the warmup rule",
    },
    {
        "stage": "eval",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 166,
        # eval_acceptance 98 s (decoding: target 11.8 + lookup 6.8 + drafter 16.3 + drafter and
        # lookup 9.9 = 44.8 s) + eval_ddtree 68 s (4 prompts: target 4.6 + chain 7.7 + tree
        # 5.2 = 17.5 s); fixed_s: the rest (103.7 s: imports, loading the 16 GB target and the
        # drafter, CUDA graphs, the tau_sim check), which does not grow with prompts
        "workload": {
            "prompts": 8,
            "new_tokens": 128,
            "target_tokens_per_s": 85.8,
            "fixed_s": 103.7,
        },
        "source": f"{REHEARSAL_8B_ONE_RUN}, rule_seconds eval_acceptance 98 + eval_ddtree 68; "
        "the eval logs' decoding lines",
        "date": "2026-12-04",
        "machine": H200,
        "config": "eval.max_prompts 8, eval.ddtree.max_prompts 4, bf16",
    },
    {
        "stage": "tokenize",
        "target": "qwen3-8b",
        "gpu": "h200",
        # tokens/s beyond the fixed part: the train split (512 rows, about 1.18M tokens before
        # truncation: 512 x (216 + 2,087)) took 35 s, the eval split (8 rows) 32 s: the fixed
        # part is about 32 s (process pool, Qwen3's tokenizer), the tokens about 3 s, read off
        # whole seconds (2-4 s: 290K-590K tokens/s): a rough rate
        "value": 390000,
        "workload": {"num_proc": 8, "fixed_s": 32, "tokens": 1_180_000},
        "source": f"{REHEARSAL_8B}, run1_rule_seconds tokenize eval 32 / train 35",
        "date": "2026-12-03",
        "machine": "16-core host of one NVIDIA H200",
        "config": "data.num_proc 8",
    },
    # -- Qwen3-8B shapes (random weights), 5-layer B = 16 drafter, rows uniform in (1536, 2560]
    {
        "stage": "train",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 17555,
        # rows uniform in (1536, 2560], the first quarter of each a prompt (bench/gpu.py)
        "workload": {
            "length": 2048,
            "prompt": 512,
            "anchors": 256,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": f"{PIPELINE_0P1}, sections.pipeline.runs['0+1'].tokens_per_s",
        "date": "2026-12-02",
        "machine": H200,
        "config": "bench/gpu.py --sections drafter,warm,pipeline --anchors 256 --micro-batch 4",
    },
    {
        "stage": "features",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 32328,
        "workload": {
            "length": 1850,
            "prompt": 462,
            "anchors": 256,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": "BENCHMARKS.md 2026-12-02, target features compiled; bench/results/"
        "2026-12-02-h200-gpu-bench-target-compiled.json (production row: 7,400 tokens in 4 rows)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "bench/gpu.py --no-pipeline (4 x 2560, early stop at layer 34, compiled)",
    },
    {
        "stage": "drafter_step",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 32269,
        "workload": {
            "length": 2144.5,
            "prompt": 536,
            "anchors": 256,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": f"{PIPELINE_0P1}, drafter_step['256 anchors, 4x2560'] production row "
        "(0.2658 s for 8,578 context tokens)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "compiled layers + flex attention, fused CE compiled, fused AdamW",
    },
    {
        "stage": "warmup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 205,
        "workload": {"shapes": 1, "later_s": 32, "anchors": 512},
        "source": "BENCHMARKS.md 2026-12-02 (evening), drafter step table: cold first step 205 s "
        "(512 anchors, 2 x 2560, compile.scope layers); later_s: the 2026-11-30 warmup entry's "
        "second and third shapes (36.5 and 27.4 s)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "bench/gpu.py --sections drafter,warm --anchors 512",
    },
    {
        "stage": "startup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 27.9,
        "workload": {},
        "source": f"{PIPELINE_0P1}, runs['0+1'].startup_s (imports 18.0, setup 3.4, compile 6.3)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "dflash train 0 + 1, compile cache warm",
    },
    # -- SmolLM2-135M (the real model), config/h200.yaml: 5-layer drafter, 96 anchors
    {
        "stage": "regenerate",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 50428,
        # prompt_tokens: estimated from that data's prompt tiers (turns per tier, BENCHMARKS.md
        # 2026-12-02 late, times the tier's midpoint); new_tokens: 10,477,333 over 33,273 turns
        # tiers: 256, 512, 1,024, 2,048, all used (BENCHMARKS.md 2026-12-02 late, tier table)
        "workload": {
            "batch": 1024,
            "prompt_tokens": 619,
            "new_tokens": 315,
            "max_new_tokens": 512,
            "tiers": 4,
            "tokens": 10477333,
        },
        "source": f"{RECIPE_END_TO_END}, regenerate_train (10,477,333 new tokens in 207.8 s)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "config/h200.yaml at 9e1a541: static engine, flex attention, bf16",
    },
    {
        "stage": "tokenize",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 622000,
        "workload": {"num_proc": 8, "tokens": 13_070_000},
        "source": "BENCHMARKS.md 2026-12-01, snakemake all with config/h200.yaml: tokenize (train) "
        "21 s for 11,783 rows of mean 1,109.4 tokens; bench/results/"
        "2026-12-01-h200-snakemake-all-512-anchors.json",
        "date": "2026-12-01",
        "machine": "16-core host of one NVIDIA H200",
        "config": "data.num_proc 8",
    },
    {
        "stage": "warmup",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 154,
        "workload": {"shapes": 4, "later_s": 38.5, "anchors": 96},
        "source": f"{RECIPE_END_TO_END}, stage_s['warmup_compile (beside regeneration)']",
        "date": "2026-12-02",
        "machine": H200,
        "config": "config/h200.yaml: buckets [256, 512, 1024, 2048], 5 layers",
    },
    {
        "stage": "train",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 288446,
        # length: that data's stats (11,783 rows, mean 1,109.4 tokens, the 2026-12-01 entry);
        # prompt: length less the 10,477,333 new tokens over its 11,633 regenerated rows (901)
        "workload": {
            "length": 1109,
            "prompt": 208,
            "anchors": 96,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": f"{RECIPE_END_TO_END}, train_summary.tokens_per_s (8,071 steps)",
        "date": "2026-12-02",
        "machine": H200,
        "config": "config/h200.yaml at 9e1a541, colocated 0 + 1",
    },
    {
        "stage": "startup",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 33.4,
        "workload": {},
        "source": f"{RECIPE_END_TO_END}, train_summary.startup_s",
        "date": "2026-12-02",
        "machine": H200,
        "config": "config/h200.yaml",
    },
    {
        "stage": "eval",
        "target": "smollm2-135m",
        "gpu": "h200",
        "value": 387,
        "workload": {"prompts": 104, "new_tokens": 256, "target_tokens_per_s": 318.8},
        "source": f"{RECIPE_END_TO_END}, stage_s eval_acceptance 261 + eval_ddtree 126; "
        "eval_acceptance.baselines.target.tokens_per_s",
        "date": "2026-12-02",
        "machine": H200,
        "config": "config/h200.yaml: bf16, lookup and drafter+lookup, DDTree 16/64 on 36 prompts",
    },
]

# Device-to-device copy bandwidth measured beside the 8B benches: what a batch-1 decoding step
# can read at best (bench/gpu.py ceilings, 2026-12-02, one H200: 4.1 and 4.12 TB/s).
H200_COPY_TB_S = 4.1
