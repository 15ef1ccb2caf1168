"""The time of each stage: a measured rate used as it is, or scaled to the plan ("projected").

A stage starts from the measurement `pick` chooses. It is "measured" only where the plan's target
shape, GPU kind and workload are the measurement's; otherwise the stage's own law scales it and
the figure says how: training by useful FLOPs per sample, regeneration by the bandwidth roofline
of a decoding step, evaluation by the time of a batch-1 target forward, other GPU kinds by their
datasheet's peak (training) or bandwidth (decoding). GPU counts scale linearly (stated).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from dflash.errors import UserError
from dflash.plan.basis import (
    MEMORY_USE,
    TRAIN_TARGET_SHARE,
    Figure,
    Plan,
    basis,
    close,
    kilo,
    pick,
    rate_shape,
    same_setting,
)
from dflash.plan.rates import GPUS, H200_COPY_TB_S
from dflash.plan.shapes import (
    BF16,
    CHECKPOINT_BYTES_PER_PARAM,
    Data,
    Drafter,
    Shape,
    drafter_flops,
    drafter_params,
    feature_flops,
    sample_flops,
)


def roofline(
    shape: Shape, gpu: str, batch: int, prompt: float, new: float, width: int = 1
) -> tuple[float, float]:
    """(new tokens/s, bytes per step) of decoding steps that read the weights and every row's live
    cache (prompt + half the answer on average) at the datasheet bandwidth of `width` GPUs, or
    that compute at their datasheet peak if that is slower."""
    step_bytes = shape.params * BF16 + batch * (prompt + new / 2) * shape.kv_bytes
    spec = GPUS[gpu]
    read_s = step_bytes / (width * spec["tb_s"] * 1e12)
    compute_s = batch * 2 * shape.params / (width * spec["tflops"] * 1e12)
    return batch / max(read_s, compute_s), step_bytes


def replica_width(p: Plan) -> int:
    """GPUs one copy of the target needs to decode: its weights in at most 3/4 of the memory
    regeneration may use (one for an 8B target on any kind here, two for 70B on an H200)."""
    usable = GPUS[p.gpu]["gb"] * 1e9 * MEMORY_USE * 0.75
    width = math.ceil(p.shape.params * BF16 / usable)
    if width > p.gpus:
        raise UserError(
            f"--gpus {p.gpus}: the target's {p.shape.params * BF16 / 1e9:.0f} GB of weights need "
            f"{width} x {p.gpu.upper()} to decode"
        )
    return width


def fit_batch(p: Plan, width: int) -> tuple[int, str]:
    """Rows per decoding step: --regen-batch, or fewer where their caches do not fit. Every row
    reserves the longest prompt + the cap (one engine for every prompt length, flex attention)."""
    reserve = f"{p.max_length} + {p.max_new_tokens} cache tokens"
    memory = width * GPUS[p.gpu]["gb"]
    free = memory * 1e9 * MEMORY_USE - p.shape.params * BF16
    fits = int(free // ((p.max_length + p.max_new_tokens) * p.shape.kv_bytes))
    if fits >= p.regen_batch:
        return p.regen_batch, f"--regen-batch, rows of {reserve}"
    return max(fits, 1), f"what fits in {MEMORY_USE:.0%} of {memory} GB: rows of {reserve}"


def drain_steps(engines: int, max_new_tokens: int) -> float:
    """Decode steps a shard spends past its full-batch ones: each engine (a prompt tier, in
    measurements from before one engine took every prompt length) ends with its last turns
    finishing while fewer and fewer rows are busy, half of `max_new_tokens` steps on average (a
    whole wave of turns that each run to the cap: 0 to max_new_tokens steps)."""
    return engines * max_new_tokens / 2


def regen_matches(w: dict, d: Data) -> bool:
    """The plan's data are the measurement's: its means per row where it has them, else per turn."""
    prompt, new = (
        (w["row_prompt_tokens"], w["row_new_tokens"])
        if "row_new_tokens" in w
        else (w["prompt_tokens"], w["new_tokens"])
    )
    return close(d.prompt_tokens, prompt) and close(d.new_tokens, new)


def regeneration(p: Plan) -> Figure:
    d = p.data
    width = replica_width(p)
    batch, why = fit_batch(p, width)

    def near(r):
        w = r["workload"]
        return (not regen_matches(w, d), abs(math.log(batch / w["batch"])))

    r = pick(p, "regenerate", near)
    w = r["workload"]
    ref_roof, _ = roofline(rate_shape(r), r["gpu"], w["batch"], w["prompt_tokens"], w["new_tokens"])
    # the measurement's tokens took full-batch steps plus its engines' (tiers') drains: its fraction of the
    # roofline is that of its mean step, as if every step had been full (no `tokens`: no drain)
    fraction = r["value"] / ref_roof
    if "tokens" in w:
        steps = w["tokens"] / w["batch"] + drain_steps(w["tiers"], w["max_new_tokens"])
        fraction *= steps * w["batch"] / w["tokens"]
    roof, step_bytes = roofline(p.shape, p.gpu, batch, d.prompt_tokens, d.new_tokens, width)
    measured = (
        same_setting(r, p)
        and batch == w["batch"]
        and regen_matches(w, d)
        and p.max_new_tokens == w["max_new_tokens"]
    )
    copies = p.gpus // width
    shard_tokens = d.samples * d.new_tokens / copies
    if measured:
        rate = r["value"]
        seconds = shard_tokens / rate
        how = "the rate measured (its drain included)"
    else:
        rate = fraction * roof  # full-batch steps of one copy of the target
        # the drain, where the measurement's fraction is of full-batch steps (else it has it in):
        # one engine a shard (flex attention, as every GPU config sets)
        engines = 1 if "tokens" in w else 0
        drain = drain_steps(engines, p.max_new_tokens)
        seconds = (shard_tokens / batch + drain) * batch / rate
        how = (
            f"{fraction:.2f} of the bandwidth roofline (the fraction measured, at batch "
            f"{w['batch']}, of its full-batch steps); batch {batch} ({why}); a step reads "
            f"{step_bytes / 1e9:.1f} GB (weights + each row's KV of {d.prompt_tokens:.0f} + "
            f"{d.new_tokens:.0f}/2 tokens; a sample taken as one turn) at {width} x "
            f"{GPUS[p.gpu]['tb_s']} TB/s: roofline {kilo(roof)} tokens/s"
        )
        if engines:
            how += (
                f"; + {drain:,.0f} steps a shard for its drain, {p.max_new_tokens:,} / 2 "
                "(--max-new-tokens)"
            )
    if width > 1:
        how += f"; each copy split over {width} GPUs (tensor parallel, not in dflash yet: ideal)"
    if copies > 1:
        how += f"; x {copies} copies, a shard each"
    rate_text = f"{kilo(shard_tokens / seconds / width)} new tokens/s per GPU"
    return Figure("regeneration", seconds, rate_text, basis(measured), how, r["source"])


def tokenization(p: Plan) -> Figure:
    r = pick(p, "tokenize")
    w = r["workload"]
    tokens = p.data.samples * (p.data.prompt_tokens + p.data.new_tokens)
    # CPU work: the tokenizer matters, not the GPU; and the amount, the rate having a fixed part
    measured = rate_shape(r) == p.shape and close(tokens, w["tokens"])
    fixed = w.get("fixed_s", 0)
    seconds = fixed + tokens / r["value"]
    how = f"on the host's CPUs at the rate measured ({w['tokens'] / 1e6:,.2f}M tokens)"
    if fixed:
        how += f", + {fixed} s measured whatever the rows (process pool, tokenizer)"
    if not measured:
        how += " with another target's tokenizer, taken as it is"
    rate = f"{kilo(r['value'])} tokens/s, {r['workload']['num_proc']} processes"
    return Figure("tokenization", seconds, rate, basis(measured), how, r["source"])


def anchors_of(r: dict) -> int | None:
    """The anchors a warmup was measured at (a run's own record does not say: the run's)."""
    return r["workload"].get("anchors")


def warmup(p: Plan) -> Figure:
    r = pick(p, "warmup", lambda r: anchors_of(r) not in (None, p.drafter.anchors))
    w = r["workload"]
    seconds = max(w["later_s"] * p.buckets, r["value"] + (p.buckets - w["shapes"]) * w["later_s"])
    measured = (
        same_setting(r, p)
        and p.buckets == w["shapes"]
        and anchors_of(r) in (None, p.drafter.anchors)
    )
    at = anchors_of(r) or "the run's"
    how = (
        f"{r['value']} s measured for {w['shapes']} shape{'s' * (w['shapes'] > 1)} at "
        f"{at} anchors, "
        f"{w['later_s']} s a further one; {p.buckets} bucket shapes (--buckets); compiling is "
        "host work, taken as it is on other GPU kinds; runs beside regeneration"
    )
    shapes = f"{p.buckets} bucket shapes"
    return Figure("compile warmup", seconds, shapes, basis(measured), how, r["source"])


def useful_flop_rate(r: dict, stage: str) -> tuple[float, str]:
    """A measurement's useful FLOP/s (its tokens/s times its FLOPs per token), and its words."""
    w, shape = r["workload"], rate_shape(r)
    n, prompt = w["length"], w["prompt"]
    d = Drafter(w["drafter_layers"], w["block_size"], w["anchors"])
    flops = {
        "train": sample_flops(shape, d, n, prompt),
        "features": feature_flops(shape, n),
        "drafter_step": drafter_flops(shape, d, n, prompt),
    }[stage]
    rate = r["value"] * flops / n
    words = (
        f"{kilo(r['value'])} tokens/s measured at {n:,.0f} tokens and {w['anchors']} anchors "
        f"= {rate / 1e12:.0f} TFLOP/s useful"
    )
    return rate, words


def training(p: Plan) -> Figure:
    n, prompt = p.data.length(p.max_length), p.data.prompt_tokens
    per_sample = sample_flops(p.shape, p.drafter, n, prompt)
    if p.targets == 0:
        r = pick(p, "train", lambda r: train_distance(r["workload"], p, n))
        flop_s, words = useful_flop_rate(r, "train")
        samples_s = p.gpus * flop_s * peak_ratio(r["gpu"], p.gpu) / per_sample
        w = r["workload"]
        measured = (
            same_setting(r, p)
            and (w["anchors"], w["drafter_layers"], w["block_size"]) == astuple_drafter(p.drafter)
            and close(n, w["length"])
        )
        how = f"colocated 0 + {p.gpus}: {p.gpus} x one GPU's rate (linear)"
    else:
        halves, sources = [], []
        for stage, flops in (
            ("features", feature_flops(p.shape, n)),
            ("drafter_step", drafter_flops(p.shape, p.drafter, n, prompt)),
        ):
            r = pick(p, stage)
            count = p.targets if stage == "features" else p.drafters
            flop_s, part = useful_flop_rate(r, stage)
            halves.append((count * flop_s * peak_ratio(r["gpu"], p.gpu) / flops, f"{stage} {part}"))
            sources.append(r["source"])
        samples_s = min(rate for rate, _ in halves)
        words = "; ".join(part for _, part in halves) + " (each alone: no transfer or waiting)"
        measured, r = False, {**r, "source": "; ".join(sources)}
        how = f"{p.targets} + {p.drafters}: the slower of the target and the drafter GPUs"
    if not measured:
        how += (
            f"; scaled by useful FLOPs per sample ({per_sample / 1e12:.1f} TFLOP at {n:,.0f} "
            f"tokens and {p.drafter.anchors} anchors): {words}"
        )
    if p.gpu != r["gpu"]:
        how += f"; x {peak_ratio(r['gpu'], p.gpu):.2f} datasheet bf16 peak {r['gpu']} -> {p.gpu}"
    if p.shape.params * BF16 > TRAIN_TARGET_SHARE * GPUS[p.gpu]["gb"] * 1e9:
        how += (
            f"; NB dflash train holds a whole target on each {'GPU' if p.targets == 0 else 'target GPU'}: "
            f"{p.shape.params * BF16 / 1e9:.0f} GB of weights beside the drafter do not fit "
            f"{GPUS[p.gpu]['gb']} GB (the time assumes they did)"
        )
    startup = pick(p, "startup")
    stalls, words = checkpoint_s(p)
    how += f"; + {startup['value']} s from process start to the first step; {words}"
    seconds = p.data.samples * p.epochs / samples_s + startup["value"] + stalls
    rate = f"{kilo(samples_s * n / p.gpus)} tokens/s per GPU"
    return Figure("training", seconds, rate, basis(measured), how, r["source"])


def checkpoint_s(p: Plan) -> tuple[float, str]:
    """Seconds training spends on its checkpoints: each stalls the step while the state is
    copied to host memory; a thread writes and hashes it beside training, and the run waits for
    the last one's write at its end."""
    r = pick(p, "checkpoint")
    gb = CHECKPOINT_BYTES_PER_PARAM * drafter_params(p.shape, p.drafter) / 1e9
    n = p.checkpoints or p.epochs
    seconds = n * gb / r["value"] + gb / r["workload"]["write_gb_s"]
    words = (
        f"{n} checkpoint{'s' * (n > 1)} of {gb:.2f} GB (fp32 weights and AdamW moments; "
        f"{'--checkpoints' if p.checkpoints else 'one at each epoch end: --checkpoints'}): "
        f"each stalls the step for its copy to host at {r['value']} GB/s, the last one's write "
        f"at {r['workload']['write_gb_s']} GB/s is awaited, {seconds:.0f} s"
    )
    return seconds, words


def train_distance(w: dict, p: Plan, n: float) -> tuple:
    """How far a training measurement's workload is from the plan's: the drafter first, then
    the row length."""
    drafter = (w["anchors"], w["drafter_layers"], w["block_size"]) != astuple_drafter(p.drafter)
    return drafter, abs(math.log(n / w["length"]))


def astuple_drafter(d: Drafter) -> tuple[int, int, int]:
    return d.anchors, d.layers, d.block_size


def peak_ratio(src: str, dst: str) -> float:
    return GPUS[dst]["tflops"] / GPUS[src]["tflops"]


def forward_s(shape: Shape, gpu: str, launch_s: float, width: int = 1) -> float:
    """A batch-1 target forward: its weights read at the copy bandwidth measured on an H200
    (scaled by datasheet bandwidth on other kinds, over `width` GPUs), or the launch-bound time
    measured, whichever is longer."""
    copy = width * H200_COPY_TB_S * 1e12 * GPUS[gpu]["tb_s"] / GPUS["h200"]["tb_s"]
    return max(launch_s, shape.params * BF16 / copy)


def evaluation(p: Plan) -> Figure:
    r = pick(p, "eval")
    w = r["workload"]
    launch_s = 1 / w["target_tokens_per_s"]
    width = replica_width(p)
    ratio = forward_s(p.shape, p.gpu, launch_s, width) / forward_s(
        rate_shape(r), r["gpu"], launch_s
    )
    scale = p.eval_prompts / w["prompts"] * p.eval_new_tokens / w["new_tokens"]
    measured = same_setting(r, p) and scale == 1
    fixed = w.get("fixed_s", 0)
    how = (
        f"{r['value']:.0f} s measured for {w['prompts']} prompts x {w['new_tokens']} new tokens"
        + (f", {fixed:.0f} s of it fixed (loading, graphs: taken as it is)" if fixed else "")
        + f"; the {'rest' if fixed else 'whole'} x {scale:.2f} for {p.eval_prompts} x "
        f"{p.eval_new_tokens} (--eval-prompts, --eval-new-tokens); x {ratio:.2f} for a batch-1 "
        f"target forward (the larger of the {launch_s * 1e3:.1f} ms measured and the weights "
        "read at the copy bandwidth)"
    )
    how += f"; one copy of the target on {width} GPU{'s' * (width > 1)}"
    seconds = fixed + (r["value"] - fixed) * scale * ratio
    return Figure("evaluation", seconds, "batch 1, one copy", basis(measured), how, r["source"])


def rest(p: Plan) -> Figure:
    """The rules outside the five stages that sit in a run's critical path: the target's
    preparation and the record's hash (both read every weight byte), the eval split's
    regeneration (it holds the only GPU first on one GPU, runs beside the train split on more),
    length statistics and the report."""
    r = pick(p, "rest")
    w = r["workload"]
    target_gb = p.shape.params * BF16 / 1e9
    target_s = w["target_s"] * target_gb / w["target_gb"]
    eval_s = w["eval_split_s"] if p.gpus == 1 else 0
    seconds = w["cpu_s"] + target_s + eval_s
    # the eval split: its rows are the evaluation's prompts (data.eval_rows)
    measured = same_setting(r, p) and p.gpus == 1 and p.eval_prompts == w["eval_rows"]
    how = (
        f"the target's preparation and the record's hash: {w['target_s']} s measured for "
        f"{w['target_gb']} GB, x {target_gb / w['target_gb']:.2f} for {target_gb:.1f} GB; "
        + (
            f"the eval split's regeneration before the train split's on one GPU, "
            f"{w['eval_split_s']} s measured for {w['eval_rows']} rows, taken as it is (its "
            "turns run one after another: waves of --max-new-tokens steps)"
            if eval_s
            else "the eval split regenerated beside the train split (a GPU each)"
        )
        + f"; length statistics and the report {w['cpu_s']} s"
    )
    return Figure("other rules", seconds, "", basis(measured), how, r["source"])


STAGES = (regeneration, tokenization, warmup, training, evaluation, rest)


def summarize(p: Plan) -> dict:
    figures = [stage(p) for stage in STAGES]
    by = {f.stage: f.seconds for f in figures}
    overlapped = max(by["regeneration"], by["compile warmup"])
    total = overlapped + by["tokenization"] + by["training"] + by["evaluation"] + by["other rules"]
    n = p.data.length(p.max_length)
    return {
        "target": {
            "name": p.name,
            "source": p.target_source,
            "shape": asdict(p.shape),
            "params": p.shape.params,
            "forward_flops_per_token": p.shape.forward_flops(n) / n,
        },
        "data": asdict(p.data) | {"training_tokens": p.data.samples * n * p.epochs},
        "epochs": p.epochs,
        "gpus": {"count": p.gpus, "kind": p.gpu, "topology": f"{p.targets}+{p.drafters}"},
        "drafter": asdict(p.drafter),
        "stages": [asdict(f) for f in figures],
        "total_s": total,
        "total_note": "the compile warmup runs beside regeneration: the longer of the two counts",
    }
