"""regenerate: rewrite every assistant turn with the target's own output, greedy or sampled.

The drafter must learn the target's distribution, and evaluation measures acceptance against the
target's own output, so training responses come from the target itself, in the mode it will be
served in (`data.regenerate.temperature`, top_p, top_k; `data.chat_template_kwargs`, e.g.
thinking off). Sampled rows draw from streams keyed by the run's seed, the row and the turn
(`dflash.data.generation`), so a rerun or a resumed run writes the same rows. The work is split into
fixed batches planned from the whole shard (rows sorted by prompt length to limit padding); each
finished batch is saved atomically in a work folder outside Snakemake's declared outputs. A killed
run resumes at the first unfinished batch with the same batch composition, so its output is the
same as an uninterrupted run's, with no row lost or duplicated. Shards split rows by `id`, never by
position. The decoding itself is `dflash.data.generation` (transformers' `generate`, or the static
engine with rows refilled as they finish) or `dflash.data.regen_vllm` (vLLM, where installed).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import polars as pl
import torch
from tqdm import tqdm

from dflash.config import expand_user
from dflash.data.continuous import regenerate_continuous
from dflash.data.expand import CONVERSATION, read_rows
from dflash.data.generation import Conversation, Generator, plan_batches, regenerate_batch
from dflash.data.regen_vllm import VllmTurns, require_vllm, visible_gpu
from dflash.errors import UserError
from dflash.filehash import HashCache
from dflash.gpus import claim_gpu
from dflash.io import atomic_path, read_json, sha256_file, sha256_json, write_json
from dflash.manifest import code_hash, environment_hash
from dflash.model.decoder import supports_static
from dflash.model.memory import decode_weight_bytes, kv_bytes_per_token, peak_memory_gb
from dflash.model.sampling import Sampling, serving_mode

log = logging.getLogger(__name__)

REGENERATED_SCHEMA = {
    "id": pl.String,
    "source": pl.String,
    "conversations": CONVERSATION,
    # indices (into conversations) of assistant turns cut off at max_new_tokens
    "truncated_turns": pl.List(pl.Int32),
    # per assistant turn, the token ids exactly as the target generated them (stop token
    # included when it finished): tokenize uses them instead of re-encoding the text
    "turn_token_ids": pl.List(pl.List(pl.Int32)),
}


def in_shard(row_id: str, shard: int, shards: int) -> bool:
    return int(row_id[:12], 16) % shards == shard


def _fingerprint(
    input_path: Path, target_dir: Path, params: dict, shard: int, shards: int, hashes: HashCache
) -> str:
    """Identifies resumable work: same input, target, parameters, shard, code and environment.

    The target by its files' content, from the cache the workflow fills when it builds the DAG
    (dflash.filehash: a stat per file): new weights of the same size and date (`cp -p`) must
    not resume batches the old ones wrote. Code and environment are included so that a rerun
    Snakemake triggers for a code or package change really regenerates.
    """
    target_files = hashes.tree(target_dir)
    hashes.save()
    return sha256_json(
        {
            "input": sha256_file(input_path),
            "target": target_files,
            "params": params,
            "shard": shard,
            "shards": shards,
            "code": code_hash(__name__),
            "env": environment_hash(),
        }
    )[:16]


def _load_part(part: Path) -> list[dict]:
    return [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines()]


def _save_part(part: Path, rows: list[dict]) -> None:
    with atomic_path(part) as tmp:
        tmp.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )


def _run_batches(gen, plan, by_id, workdir, max_prompt, progress) -> list[dict]:
    """transformers' `generate` over the planned batches, one saved part per batch; a resumed
    run regenerates the same batches, so its rows are the same as an uninterrupted run's."""
    done = []
    for k, ids in enumerate(plan):
        part = workdir / f"batch-{k:05d}.jsonl"
        if part.exists():
            saved = _load_part(part)
            if [r["id"] for r in saved] == ids:
                done += saved
                progress(saved, [], 0)
                continue
            log.warning("%s does not match the plan; regenerating it", part)
        convs, tokens = regenerate_batch(gen, [by_id[i] for i in ids], max_prompt)
        batch = [c.result() for c in convs]
        _save_part(part, batch)
        done += batch
        progress(batch, convs, tokens)
    return done


def _run_saving_done(plan, by_id, workdir, batch_size, progress, decode) -> list[dict]:
    """`decode(rows, on_done)` over the rows not saved yet, finished conversations saved in parts
    of `batch_size` as they complete. A resumed run skips the saved ones (a row's tokens depend
    only on its own prompt, so the rest come out as in an uninterrupted run)."""
    parts = sorted(workdir.glob("done-*.jsonl"))
    done = [r for part in parts for r in _load_part(part) if r["id"] in by_id]
    progress(done, [], 0)
    saved = {r["id"] for r in done}
    todo = [by_id[i] for ids in plan for i in ids if i not in saved]
    pending: list[dict] = []

    def flush():
        _save_part(workdir / f"done-{len(parts):05d}.jsonl", pending)
        parts.append(pending)
        done.extend(pending)
        pending.clear()

    def on_done(conv: Conversation):
        row = conv.result()
        pending.append(row)
        progress([row], [conv], sum(map(len, row["turn_token_ids"])))
        if len(pending) >= batch_size:
            flush()

    if todo:
        decode(todo, on_done)
        if pending:
            flush()
    return done


def use_static_engine(choice: str, model) -> bool:
    if choice == "static" and not supports_static(model):
        raise UserError(
            f"data.regenerate.engine: static: the target's architecture "
            f"({model.config.model_type}) has no static decoder here; use auto or hf"
        )
    # auto: on a CPU the step over the whole preallocated cache is no faster than `generate`
    # (measured: 31 s vs 25 s for 48 rows), on CUDA its graphs are what make it fast
    on_cuda = next(model.parameters()).device.type == "cuda"
    return choice == "static" or (choice == "auto" and on_cuda and supports_static(model))


def regenerate_shard(args, params: dict, max_prompt: int) -> dict:
    """Regenerate the shard's rows; an assistant turn whose prompt already fills `max_prompt`
    tokens (the training length) ends its conversation there."""
    rows = [r for r in read_rows(args.input) if in_shard(r["id"], args.shard, args.shards)]
    by_id = {r["id"]: r for r in rows}
    served = params["engine"] == "vllm"
    mode = serving_mode(args.config)
    sampling, template = Sampling.of(params), mode["chat_template_kwargs"]
    seed = mode.get("seed", 0)  # greedy answers draw nothing
    if served:
        require_vllm()  # before a GPU is claimed or anything loads
        device = claim_gpu() if params["device"] == "auto" else torch.device(params["device"])
        visible_gpu(device)
        max_len = max_prompt + params["max_new_tokens"]
        gen = VllmTurns(args.target, params["dtype"], params["max_new_tokens"], max_len, sampling,
                        seed, params["min_cap"])  # fmt: skip
        gen.template = template
        dtype = torch.bfloat16 if params["dtype"] == "auto" else getattr(torch, params["dtype"])
    else:
        gen = Generator(args.target, params["dtype"], params["device"], params["max_new_tokens"],
                        sampling, seed, template, params["min_cap"])  # fmt: skip
        device, dtype = gen.device, gen.dtype
    # what `auto` resolved to is part of the work's identity: other hardware, other tokens
    resolved = {"max_prompt": max_prompt, "torch_dtype": str(dtype), "on": device.type}
    hashes = HashCache(expand_user(args.config["cache_dir"]))
    # the seed and template arguments only where they change the rows: a greedy run's work
    # folder is the one it always was
    identity = {**params, **resolved} | {k: v for k, v in mode.items() if k in ("seed",)}
    if template:
        identity["chat_template_kwargs"] = template
    workdir = args.workdir / _fingerprint(
        args.input, args.target, identity, args.shard, args.shards, hashes
    )
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file = workdir / "plan.json"
    if plan_file.exists():
        plan = read_json(plan_file)
    else:
        plan = plan_batches(rows, gen.tokenizer, params["batch_size"], max_prompt, template)
        write_json(plan_file, plan)
    static = not served and use_static_engine(params["engine"], gen.model)
    counts = {"new_tokens": 0, "dropped_turns": 0}
    started = time.perf_counter()
    bar = tqdm(total=len(rows), desc=f"regenerate shard {args.shard}/{args.shards}", unit="row")

    def progress(rows_done, convs, tokens):
        counts["new_tokens"] += tokens
        counts["dropped_turns"] += sum(c.dropped_turns for c in convs)
        bar.update(len(rows_done))
        bar.set_postfix(tok_s=f"{counts['new_tokens'] / (time.perf_counter() - started):.0f}")

    tiers: list[dict] = []  # where the static engine's time went, per prompt tier

    def continuous(todo, on_done):
        # the batch is fixed (not cut to what is left) so that every step has the same shape
        regenerate_continuous(gen, todo, max_prompt, on_done, params["batch_size"],
                              attention=params["attention"], stats=tiers)  # fmt: skip

    def waves(todo, on_done):  # vLLM: every next turn in one call
        regenerate_batch(gen, todo, max_prompt, on_done)

    if served or static:
        decode = waves if served else continuous
        done = _run_saving_done(plan, by_id, workdir, params["batch_size"], progress, decode)
    else:
        done = _run_batches(gen, plan, by_id, workdir, max_prompt, progress)
    bar.close()
    elapsed = time.perf_counter() - started
    order = {row_id: i for i, row_id in enumerate(r["id"] for r in rows)}
    done.sort(key=lambda r: order[r["id"]])
    with atomic_path(args.output) as tmp:
        pl.DataFrame(done, schema=REGENERATED_SCHEMA).write_parquet(tmp, statistics=False)
    rate = {
        "rows": len(done),
        "mode": mode["label"],
        "engine": engine_name(served, static),
        "dtype": str(dtype).removeprefix("torch."),
        "new_tokens_this_run": counts["new_tokens"],
        "turns_dropped_past_max_length_this_run": counts["dropped_turns"],
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(counts["new_tokens"] / elapsed, 1) if elapsed else None,
        "peak_memory_gb": peak_memory_gb(),
    }
    if tiers:
        rate |= decode_roofline(gen.model, tiers, elapsed)
    log.info("regenerate: %s", rate)
    for tier in tiers:  # where the static engine's time went
        log.info("regenerate: prompt tier %s", tier)
    return rate


def engine_name(served: bool, static: bool) -> str:
    if served:
        import vllm

        return f"vllm {vllm.__version__}"
    return "static" if static else "hf"


def decode_roofline(model, tiers: list[dict], elapsed: float) -> dict:
    """The static engine's decode steps at the GPU's datasheet bandwidth: each step reads the
    weights (all but the input embedding, which is gathered) and every busy row's cache up to
    its position. The stage's share of it counts prefill, setup and idle rows as lost time."""
    from dflash.plan.rates import GPUS

    if not torch.cuda.is_available():
        return {}
    name = torch.cuda.get_device_name(next(model.parameters()).device).lower()
    spec = next((v for k, v in GPUS.items() if k in name), None)
    if spec is None:
        return {}
    weights, per_token = decode_weight_bytes(model), kv_bytes_per_token(model)
    steps = sum(t["steps"] for t in tiers)
    kv_reads = sum(t["kv_reads"] for t in tiers)
    seconds = (steps * weights + kv_reads * per_token) / (spec["tb_s"] * 1e12)
    return {
        "decode_roofline_s": round(seconds, 2),
        "of_decode_roofline": round(seconds / elapsed, 3) if elapsed else None,
    }


def run(args) -> dict:
    params = dict(args.config["data"]["regenerate"])
    torch.manual_seed(0)
    rate = regenerate_shard(args, params, args.config["data"]["max_length"])
    # the manifest records what `auto` chose here, and the mode the answers were made in
    resolved = {k: rate[k] for k in ("engine", "dtype")}
    return {"params": {"resolved": resolved, "mode": serving_mode(args.config)}}
