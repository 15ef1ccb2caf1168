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

# Shapes of the presets: the fields of a HF config.json that `dflash plan` reads.
PRESETS = {
    # bench/qwen3-8b-config/config.json (Qwen3-8B's published config, the shapes every 8B bench uses)
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # bench/configs/smollm2-135m/config.json (the embedded default's and config/h200.yaml's target)
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}

# Datasheet figures per GPU (dense bf16 TFLOP/s, HBM TB/s, memory GB). Only h200 has measurements
# here; the others are reached by the ratio of these figures (labelled as projections).
GPUS = {
    "h200": {"tflops": 989, "tb_s": 4.8, "gb": 141, "source": "NVIDIA H200 SXM datasheet"},
    "h100": {"tflops": 989, "tb_s": 3.35, "gb": 80, "source": "NVIDIA H100 SXM datasheet"},
    "a100": {"tflops": 312, "tb_s": 2.039, "gb": 80, "source": "NVIDIA A100 80GB SXM datasheet"},
    "b200": {
        "tflops": 2250,
        "tb_s": 8.0,
        "gb": 180,
        "source": "NVIDIA DGX B200 datasheet, per GPU",
    },
}

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

RATES = [
    # -- Qwen3-8B shapes (random weights) in the workflow: the 8B rehearsal, config/rehearsal-8b.yaml
    # (512 ShareGPT conversations, every turn, each answer 1,024 tokens: a random target never
    # stops). Earlier entries win ties, so these come before the benches' below.
    {
        "stage": "regenerate",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 5070,
        # per turn: new_tokens 1,069,540 over 1,048 turns (the tiers' turn counts); prompt_tokens
        # estimated, each tier's turns counted at its midpoint (128, 384, 768, 1,536, 2,304), as
        # the JSON's roofline does. Per row (what a plan's data are in): 2,089 new tokens
        # (1,069,540 / 512); 216 prompt tokens is an estimate (not measured by the run).
        # tiers: prompt tiers 256 ... 2,560, all five used; steps 11,466 (4,096 + 1,024 + 1,075
        # + 3,072 + 2,199), busy rows 13-91 % by tier
        "workload": {
            "batch": 128,
            "prompt_tokens": 1053,
            "new_tokens": 1021,
            "max_new_tokens": 1024,
            "tiers": 5,
            "tokens": 1069540,
            "row_prompt_tokens": 216,
            "row_new_tokens": 2089,
        },
        "source": f"{REHEARSAL_8B}, regenerate_train of the third run (1,069,540 new tokens in "
        "210.96 s, the decode step's layers fused; the first run's 254.18 s unfused; the same "
        "rows, tiers and steps)",
        "date": "2026-12-03",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml at 708b4b7: static engine, flex attention, bf16",
    },
    {
        "stage": "train",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 16663,
        # length: 16,662.8 tokens/s x 0.5017 s a steady step (time_split) / 4 rows = 2,090
        # tokens a row after truncation at 2,560; prompt: the rows' 216 estimated, as above
        "workload": {
            "length": 2090,
            "prompt": 216,
            "anchors": 256,
            "drafter_layers": 5,
            "block_size": 16,
        },
        "source": f"{REHEARSAL_8B}, train_summary.tokens_per_s (383 steady steps, 94.9 % of "
        "the bench's 17,555)",
        "date": "2026-12-03",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: 0 + 1, batches of 4 x 2560, compiled",
    },
    {
        "stage": "warmup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 93,
        # the rule's wall (compile/warmup.json: 85.0 s, the first step 67.9 s); later_s: the
        # 2026-11-30 warmup entry's further shapes, as the bench entry below
        "workload": {"shapes": 1, "later_s": 32, "anchors": 256},
        "source": f"{REHEARSAL_8B}, run1_rule_seconds warmup_compile (beside regeneration)",
        "date": "2026-12-03",
        "machine": H200,
        "config": "config/rehearsal-8b.yaml: buckets [2560], 256 anchors, batch 4",
    },
    {
        "stage": "startup",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 28.7,
        "workload": {},
        "source": f"{REHEARSAL_8B}, train_summary.startup_s (imports 15.5, setup 6.2, compile 6.8)",
        "date": "2026-12-03",
        "machine": H200,
        "config": "dflash train 0 + 1, compile cache warm from the warmup rule",
    },
    {
        "stage": "eval",
        "target": "qwen3-8b",
        "gpu": "h200",
        "value": 130,
        # eval_acceptance 76 s (decoding: target 5.1 + lookup 5.0 + drafter 9.0 + drafter and
        # lookup 7.5 = 26.6 s) + eval_ddtree 54 s (2 prompts: target 2.5 + chain 5.3 + tree 3.8
        # = 11.6 s); fixed_s: the rest (92 s: imports, loading the 16 GB target and the
        # drafter, CUDA graphs, the tau_sim check), which does not grow with prompts
        "workload": {
            "prompts": 4,
            "new_tokens": 128,
            "target_tokens_per_s": 100.0,
            "fixed_s": 91.8,
        },
        "source": f"{REHEARSAL_8B}, run2_rule_seconds eval_acceptance 76 + eval_ddtree 54; "
        "run2_eval decoding lines",
        "date": "2026-12-03",
        "machine": H200,
        "config": "run 2 (8cf29c8): eval.max_prompts 4, eval.ddtree.max_prompts 2, bf16",
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
