"""regenerate: rewrite every assistant turn with the target's own greedy output.

The drafter must learn the target's distribution, and evaluation measures acceptance against the
target's greedy output, so training responses come from the target itself. The work is split into
fixed batches planned from the whole shard (rows sorted by prompt length to limit padding); each
finished batch is saved atomically in a work folder outside Snakemake's declared outputs. A killed
run resumes at the first unfinished batch with the same batch composition, so its output is the
same as an uninterrupted run's, with no row lost or duplicated. Shards split rows by `id`, never by
position.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import polars as pl
import torch
from tqdm import tqdm

from dflash.data.expand import read_rows
from dflash.data.sources import DataError
from dflash.errors import UserError
from dflash.io import atomic_path, read_json, sha256_file, sha256_json, write_json
from dflash.manifest import code_hash, environment_hash, write_manifest

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REGENERATED_SCHEMA = {
    "id": pl.String,
    "source": pl.String,
    "conversations": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
    # indices (into conversations) of assistant turns cut off at max_new_tokens
    "truncated_turns": pl.List(pl.Int32),
    # per assistant turn, the token ids exactly as the target generated them (stop token
    # included when it finished): tokenize uses them instead of re-encoding the text
    "turn_token_ids": pl.List(pl.List(pl.Int32)),
}


def in_shard(row_id: str, shard: int, shards: int) -> bool:
    return int(row_id[:12], 16) % shards == shard


def _prompt_ids(tokenizer, turns: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def plan_batches(rows: list[dict], tokenizer, batch_size: int) -> list[list[str]]:
    """Row ids per batch: sorted by first-prompt length (then id), cut into fixed batches."""

    def first_prompt_len(row):
        turns = row["conversations"]
        first_user = next(i for i, t in enumerate(turns) if t["role"] == "user")
        return len(_prompt_ids(tokenizer, turns[: first_user + 1]))

    order = sorted(rows, key=lambda r: (first_prompt_len(r), r["id"]))
    return [[r["id"] for r in order[i : i + batch_size]] for i in range(0, len(order), batch_size)]


class Generator:
    """Batched greedy generation with the target (left padding, KV cache)."""

    def __init__(self, target_dir: Path, dtype: str, device: str, max_new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype])
        self.model.to(self.device).eval()
        self.max_new_tokens = max_new_tokens
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *self._config_eos()} - {None})
        if not self.eos_ids:
            raise UserError(f"{target_dir}: the target defines no end-of-sequence token")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0]

    def _config_eos(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """Greedy continuations (without the end-of-turn token) and whether each finished."""
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            # A static cache avoids re-concatenating the KV cache every step (half the CPU time).
            cache_implementation="static",
        )
        results = []
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            # the ids exactly as generated, including the stop token when there is one
            results.append((row[: stop + 1], True) if stop is not None else (row, False))
        return results


def regenerate_batch(gen: Generator, rows: list[dict]) -> tuple[list[dict], int]:
    """Regenerate all assistant turns of the rows, turn by turn across the batch."""
    convs = [[dict(t) for t in r["conversations"]] for r in rows]
    truncated: list[list[int]] = [[] for _ in rows]
    turn_ids: list[list[list[int]]] = [[] for _ in rows]
    n_tokens = 0
    max_len = max(map(len, convs))
    for turn in range(max_len):
        todo = [i for i, c in enumerate(convs) if turn < len(c) and c[turn]["role"] == "assistant"]
        if not todo:
            continue
        prompts = [_prompt_ids(gen.tokenizer, convs[i][:turn]) for i in todo]
        for i, (tokens, finished) in zip(todo, gen.generate(prompts), strict=True):
            content = tokens[:-1] if finished else tokens
            convs[i][turn]["content"] = gen.tokenizer.decode(content, skip_special_tokens=True)
            turn_ids[i].append(tokens)
            n_tokens += len(tokens)
            if not finished:
                truncated[i].append(turn)
    out = [
        {
            "id": r["id"],
            "source": r["source"],
            "conversations": c,
            "truncated_turns": t,
            "turn_token_ids": ids,
        }
        for r, c, t, ids in zip(rows, convs, truncated, turn_ids, strict=True)
    ]
    return out, n_tokens


def _fingerprint(input_path: Path, target_dir: Path, params: dict, shard: int, shards: int) -> str:
    """Identifies resumable work: same input, target, parameters, shard, code and environment.

    Weights are identified by size and modification time (hashing a large target on every start
    would cost minutes), small files by content. Code and environment are included so that a
    rerun Snakemake triggers for a code or package change really regenerates.
    """
    target_files = {
        p.name: [p.stat().st_size, p.stat().st_mtime_ns]
        if p.suffix in (".safetensors", ".bin")
        else sha256_file(p)
        for p in sorted(target_dir.iterdir())
        if p.is_file()
    }
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


def regenerate_shard(args, params: dict) -> dict:
    rows = [r for r in read_rows(args.input) if in_shard(r["id"], args.shard, args.shards)]
    by_id = {r["id"]: r for r in rows}
    workdir = args.workdir / _fingerprint(args.input, args.target, params, args.shard, args.shards)
    workdir.mkdir(parents=True, exist_ok=True)
    gen = Generator(args.target, params["dtype"], params["device"], params["max_new_tokens"])
    plan_file = workdir / "plan.json"
    if plan_file.exists():
        plan = read_json(plan_file)
    else:
        plan = plan_batches(rows, gen.tokenizer, params["batch_size"])
        write_json(plan_file, plan)
    done, n_tokens, started = [], 0, time.perf_counter()
    bar = tqdm(total=len(rows), desc=f"regenerate shard {args.shard}/{args.shards}", unit="row")
    for k, ids in enumerate(plan):
        part = workdir / f"batch-{k:05d}.jsonl"
        if part.exists():
            saved = [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines()]
            if [r["id"] for r in saved] == ids:
                done += saved
                bar.update(len(ids))
                continue
            log.warning("%s does not match the plan; regenerating it", part)
        batch, tokens = regenerate_batch(gen, [by_id[i] for i in ids])
        with atomic_path(part) as tmp:
            tmp.write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in batch), encoding="utf-8"
            )
        done += batch
        n_tokens += tokens
        bar.update(len(ids))
        elapsed = time.perf_counter() - started
        bar.set_postfix(tok_s=f"{n_tokens / elapsed:.0f}")
    bar.close()
    elapsed = time.perf_counter() - started
    order = {row_id: i for i, row_id in enumerate(r["id"] for r in rows)}
    done.sort(key=lambda r: order[r["id"]])
    with atomic_path(args.output) as tmp:
        pl.DataFrame(done, schema=REGENERATED_SCHEMA).write_parquet(tmp, statistics=False)
    rate = {
        "rows": len(done),
        "new_tokens_this_run": n_tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(n_tokens / elapsed, 1) if elapsed else None,
    }
    log.info("regenerate: %s", rate)
    return rate


def merge_shards(input_path: Path, shard_files: list[Path], output: Path) -> None:
    """Concatenate shards back into the input's row order, checking nothing is lost or doubled."""
    expected = [r["id"] for r in read_rows(input_path)]
    frame = pl.concat([pl.read_parquet(f) for f in shard_files])
    got = frame["id"].to_list()
    if sorted(got) != sorted(expected):
        missing = len(set(expected) - set(got))
        doubled = len(got) - len(set(got))
        raise DataError(
            f"regenerated shards {shard_files} do not match {input_path}: "
            f"{missing} rows missing, {doubled} duplicated"
        )
    position = {row_id: i for i, row_id in enumerate(expected)}
    frame = frame.with_columns(pl.col("id").replace_strict(position).alias("_pos"))
    with atomic_path(output) as tmp:
        frame.sort("_pos").drop("_pos").write_parquet(tmp, statistics=False)


def run(args) -> None:
    params = dict(args.config["data"]["regenerate"])
    torch.manual_seed(0)
    regenerate_shard(args, params)
    if args.manifest:
        write_manifest(
            args.manifest,
            "regenerate",
            {"input": args.input},
            {"output": args.output},
            params={**params, "shard": args.shard, "shards": args.shards},
            code=(__name__,),
        )


def run_merge(args) -> None:
    merge_shards(args.input, args.shard_files, args.output)
    if args.manifest:
        write_manifest(
            args.manifest,
            "merge_shards",
            {"input": args.input},
            {"output": args.output},
            code=(__name__,),
        )
