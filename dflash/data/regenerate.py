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
from bisect import bisect_left
from collections import deque
from pathlib import Path

import polars as pl
import torch
from tqdm import tqdm

from dflash.data.expand import read_rows
from dflash.data.sources import DataError
from dflash.errors import UserError
from dflash.gpus import claim_gpu
from dflash.io import atomic_path, read_json, sha256_file, sha256_json, write_json
from dflash.manifest import code_hash, environment_hash, write_manifest
from dflash.model.engine import BatchedGreedy, supports_static
from dflash.model.precision import resolve_dtype

log = logging.getLogger(__name__)

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

        # auto: a GPU no other job holds (shards run one per GPU, in parallel), else the CPU
        self.device = claim_gpu() if device == "auto" else torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.tokenizer.padding_side = "left"
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=self.dtype)
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


class Conversation:
    """One row being regenerated: its turns so far and the assistant turns still to do. Each
    assistant turn is answered with the turns before it as the prompt, earlier assistant turns
    already replaced by the target's own answers."""

    def __init__(self, row: dict):
        self.row = row
        self.turns = [dict(t) for t in row["conversations"]]
        self.todo = [i for i, t in enumerate(self.turns) if t["role"] == "assistant"]
        self.truncated: list[int] = []
        self.turn_ids: list[list[int]] = []
        self.dropped_turns = 0

    def prompt(self, tokenizer, max_prompt: int) -> list[int] | None:
        """The next turn's prompt, or None (and the conversation ends here, see `end_here`)
        when it fills `max_prompt` tokens."""
        prompt = _prompt_ids(tokenizer, self.turns[: self.todo[0]])
        if len(prompt) < max_prompt:
            return prompt
        self.end_here()
        return None

    def answer(self, tokens: list[int], finished: bool, tokenizer) -> None:
        turn = self.todo.pop(0)
        content = tokens[:-1] if finished else tokens
        self.turns[turn]["content"] = tokenizer.decode(content, skip_special_tokens=True)
        self.turn_ids.append(tokens)
        if not finished:
            self.truncated.append(turn)

    def end_here(self) -> None:
        """Drop the next assistant turn and all after it: its prompt alone fills the training
        length, so nothing of it could be trained on."""
        self.dropped_turns = len(self.todo)
        self.turns = self.turns[: self.todo[0]]
        self.todo = []

    def result(self) -> dict:
        return {
            "id": self.row["id"],
            "source": self.row["source"],
            "conversations": self.turns,
            "truncated_turns": self.truncated,
            "turn_token_ids": self.turn_ids,
        }


def regenerate_batch(gen: Generator, rows: list[dict], max_prompt: int):
    """Regenerate all assistant turns of the rows, turn by turn across the batch (transformers'
    `generate`, every turn waiting for the batch's longest answer)."""
    convs = [Conversation(r) for r in rows]
    n_tokens = 0
    while todo := [c for c in convs if c.todo]:
        ready, prompts = [], []
        for conv in todo:
            if (prompt := conv.prompt(gen.tokenizer, max_prompt)) is not None:
                ready.append(conv)
                prompts.append(prompt)
        if ready:
            for conv, (tokens, finished) in zip(ready, gen.generate(prompts), strict=True):
                conv.answer(tokens, finished, gen.tokenizer)
                n_tokens += len(tokens)
    return convs, n_tokens


def prompt_tiers(max_prompt: int, smallest: int = 256) -> list[int]:
    """Prompt-length limits of the static engine's caches: powers of two from `smallest`, then
    `max_prompt` (a prompt is always shorter than that)."""
    tiers = []
    while smallest < max_prompt:
        tiers.append(smallest)
        smallest *= 2
    return [*tiers, max_prompt]


def regenerate_continuous(
    gen: Generator, rows: list[dict], max_prompt: int, on_done, batch: int, tiers=None
):
    """Regenerate the rows through the static engine, `batch` rows at a time, keeping every
    cache row busy: a row whose turn ends takes the same conversation's next turn or the next
    conversation at once. `on_done(conversation)` is called as each one completes; returns the
    new tokens.

    Each turn runs in the engine of its prompt's tier (`prompt_tiers`; capacity = tier +
    max_new_tokens), tiers in increasing order: a decode step attends over the whole cache, so a
    300-token prompt should not pay for a 2,560-row one. The tier is a function of the prompt's
    own length and the batch is fixed, so a row's tokens still depend only on its own prompt.
    A conversation's later turns have longer prompts: they join the same or a later tier.
    """
    tiers = tiers or prompt_tiers(max_prompt)
    queues: list[deque] = [deque() for _ in tiers]
    n_tokens = 0

    def enqueue(conv: Conversation, first: bool = False) -> None:
        prompt = conv.prompt(gen.tokenizer, max_prompt)
        if prompt is None:
            on_done(conv)
            return
        queue = queues[bisect_left(tiers, len(prompt))]
        if first:  # a conversation's next turn goes first, so conversations finish early
            queue.appendleft((conv, prompt))
        else:
            queue.append((conv, prompt))

    def end_turn(conv: Conversation, tokens: list[int], finished: bool) -> None:
        nonlocal n_tokens
        conv.answer(tokens, finished, gen.tokenizer)
        n_tokens += len(tokens)
        if conv.todo:
            enqueue(conv, first=True)
        else:
            on_done(conv)

    for row in rows:
        enqueue(Conversation(row))
    for tier, queue in zip(tiers, queues, strict=True):
        if queue:
            engine = BatchedGreedy(gen.model, batch, tier + gen.max_new_tokens, prompt_width=tier)
            _drain(gen, engine, queue, end_turn)
            del engine  # its caches and graphs, before the next tier's are allocated
    return n_tokens


def _drain(gen: Generator, engine: BatchedGreedy, queue: deque, end_turn) -> None:
    """Decode the queued (conversation, prompt) turns with every cache row kept busy; a turn
    ends at a stop token or max_new_tokens (`end_turn` may queue that conversation's next)."""
    slots: list[tuple[Conversation, list[int]] | None] = [None] * engine.batch

    def settle(slot: int) -> None:
        conv, tokens = slots[slot]
        finished = tokens[-1] in gen.eos_ids
        if finished or len(tokens) >= gen.max_new_tokens:
            slots[slot] = None
            end_turn(conv, tokens, finished)

    while queue or any(slots):
        free = [slot for slot, busy in enumerate(slots) if busy is None]
        wanted = min(engine.prefill_rows, len(queue))
        # prefill in full calls while sequences are decoding; waiting a few steps for free rows
        # costs less than a call per prompt
        if free and wanted and (len(free) >= wanted or not any(slots)):
            take = free[:wanted]
            turns = [queue.popleft() for _ in take]
            firsts = engine.prefill(take, [prompt for _, prompt in turns])
            for slot, (conv, _), token in zip(take, turns, firsts, strict=True):
                slots[slot] = (conv, [token])
                settle(slot)
            continue
        for slot, token in enumerate(engine.step()):
            if slots[slot] is not None:
                slots[slot][1].append(token)
                settle(slot)


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


def _run_continuous(gen, plan, by_id, workdir, batch_size, max_prompt, progress) -> list[dict]:
    """The static engine with rows refilled as they finish; finished conversations are saved
    in parts of `batch_size`. A resumed run skips the saved ones (a row's tokens depend only on
    its own prompt, so the rest come out as in an uninterrupted run)."""
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
        # the batch is fixed (not cut to what is left) so that every step has the same shape
        regenerate_continuous(gen, todo, max_prompt, on_done, batch_size)
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
    gen = Generator(args.target, params["dtype"], params["device"], params["max_new_tokens"])
    # what `auto` resolved to is part of the work's identity: other hardware, other tokens
    resolved = {"max_prompt": max_prompt, "torch_dtype": str(gen.dtype), "on": gen.device.type}
    workdir = args.workdir / _fingerprint(
        args.input, args.target, {**params, **resolved}, args.shard, args.shards
    )
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file = workdir / "plan.json"
    if plan_file.exists():
        plan = read_json(plan_file)
    else:
        plan = plan_batches(rows, gen.tokenizer, params["batch_size"])
        write_json(plan_file, plan)
    static = use_static_engine(params["engine"], gen.model)
    counts = {"new_tokens": 0, "dropped_turns": 0}
    started = time.perf_counter()
    bar = tqdm(total=len(rows), desc=f"regenerate shard {args.shard}/{args.shards}", unit="row")

    def progress(rows_done, convs, tokens):
        counts["new_tokens"] += tokens
        counts["dropped_turns"] += sum(c.dropped_turns for c in convs)
        bar.update(len(rows_done))
        bar.set_postfix(tok_s=f"{counts['new_tokens'] / (time.perf_counter() - started):.0f}")

    if static:
        done = _run_continuous(
            gen, plan, by_id, workdir, params["batch_size"], max_prompt, progress
        )
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
        "engine": "static" if static else "hf",
        "dtype": str(gen.dtype).removeprefix("torch."),
        "new_tokens_this_run": counts["new_tokens"],
        "turns_dropped_past_max_length_this_run": counts["dropped_turns"],
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(counts["new_tokens"] / elapsed, 1) if elapsed else None,
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
    rate = regenerate_shard(args, params, args.config["data"]["max_length"])
    if args.manifest:
        resolved = {k: rate[k] for k in ("engine", "dtype")}  # what `auto` chose here
        write_manifest(
            args.manifest,
            "regenerate",
            {"input": args.input},
            {"output": args.output},
            params={**params, "shard": args.shard, "shards": args.shards, "resolved": resolved},
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
