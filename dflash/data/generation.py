"""The target answering conversations turn by turn, greedily: a fixed-batch path (transformers'
`generate`) and a continuous one (`BatchedGreedy`: rows refilled as they finish, prompts in a few
length tiers so compiled graphs are reused). A turn is conditioned on the target's own earlier
answers, as the target would have held the conversation."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path

import torch

from dflash.data import tools
from dflash.data.bounded import encode_bounded
from dflash.data.tiers import prompt_tiers
from dflash.errors import UserError
from dflash.gpus import claim_gpu
from dflash.model.engine import BatchedGreedy
from dflash.model.memory import require_target_fits
from dflash.model.precision import resolve_dtype


def _prompt_ids(tokenizer, turns: list[dict], max_prompt: int) -> list[int]:
    """The prompt's ids; those of turns cut by characters when it is far longer than
    `max_prompt` tokens (dflash.data.bounded), which is all its callers need to know then."""

    def ids(short):
        out = tools.render(tokenizer, short, generation_prompt=True, tokenize=True)
        out = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return out, len(out)

    return encode_bounded(ids, turns, max_prompt)[0]


def plan_batches(rows: list[dict], tokenizer, batch_size: int, max_prompt: int) -> list[list[str]]:
    """Row ids per batch: sorted by first-prompt length (then id), cut into fixed batches. A
    prompt longer than `max_prompt` is never answered; its length here may be that of its cut
    turns (still longer than any that is)."""

    def first_prompt_len(row):
        turns = row["conversations"]
        first_user = next(i for i, t in enumerate(turns) if t["role"] == "user")
        return len(_prompt_ids(tokenizer, turns[: first_user + 1], max_prompt))

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
        require_target_fits(target_dir, self.dtype, self.device, "regeneration")
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


@lru_cache(maxsize=4)
def _drops_calls(tokenizer) -> bool:
    return tools.template_drops_calls(tokenizer) is not None


class Conversation:
    """One row being regenerated: its turns so far and the assistant turns still to do. Each
    assistant turn is answered with the turns before it as the prompt, earlier assistant turns
    already replaced by the target's own answers.

    A turn with tool calls is kept as the data has it (the calls, and the results after them,
    come from the tools, which regeneration cannot run); the plain answers around them are the
    target's. Where the target's template cannot render tool calls, a conversation that uses
    them is left as it is (tokenize leaves it out and counts it)."""

    def __init__(self, row: dict):
        self.row = row
        self.turns = [dict(t) for t in row["conversations"]]
        self.todo = [
            i
            for i, t in enumerate(self.turns)
            if t["role"] == "assistant" and not tools.has_calls(t)
        ]
        self.uses_tools = tools.uses_tools(self.turns)
        self.truncated: list[int] = []
        self.turn_ids: list[list[int]] = []
        self.dropped_turns = 0

    def prompt(self, tokenizer, max_prompt: int) -> list[int] | None:
        """The next turn's prompt, or None (and the conversation ends here, see `end_here`)
        when it fills `max_prompt` tokens."""
        if self.uses_tools and _drops_calls(tokenizer):
            self.todo = []
            return None
        prompt = _prompt_ids(tokenizer, self.turns[: self.todo[0]], max_prompt)
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


def regenerate_batch(gen, rows: list[dict], max_prompt: int, on_done=None):
    """Regenerate all assistant turns of the rows, turn by turn across the batch: every
    conversation's next turn in one `gen.generate` call (transformers' `generate`, every turn
    waiting for the batch's longest answer; or vLLM's, which schedules them itself).
    `on_done(conversation)` is called after each call for the conversations it completed."""
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
        for conv in todo if on_done else ():
            if not conv.todo:
                on_done(conv)
    return convs, n_tokens


def regenerate_continuous(
    gen: Generator,
    rows: list[dict],
    max_prompt: int,
    on_done,
    batch: int,
    tiers=None,
    attention: str = "sdpa",
    stats: list | None = None,
    overlap: bool = True,
):
    """Regenerate the rows through the static engine, `batch` rows at a time, keeping every
    cache row busy: a row whose turn ends takes the same conversation's next turn or the next
    conversation at once. `on_done(conversation)` is called as each one completes; returns the
    new tokens.

    Under `sdpa` each turn runs in the engine of its prompt's tier (`prompt_tiers`; capacity =
    tier + max_new_tokens), tiers in increasing order: that decode step attends over the whole
    cache, so a 300-token prompt should not pay for a 2,560-row one. Under `flex` a step reads
    only each row's live key blocks, so one engine of the largest capacity serves every turn:
    a tier's end leaves its rows idle until its longest turn ends (at 8B shapes five tiers' ends
    and two sparse tiers cost 26 s of 211), one engine has that once. The tier is a function of
    the prompt's own length and the batch is fixed, so a row's tokens still depend only on its
    own prompt. A conversation's later turns have longer prompts: they join the same or a later
    tier. Conversations with more assistant turns start first, since their turns run one after
    another and the last of them decides when the work ends. `attention` is the decode step's
    (`BatchedGreedy`); `overlap` runs the host's work beside the next step (`_drain`). Where time
    went, per tier, is appended to `stats` (`TierStats.summary`).
    """
    tiers = tiers or engine_tiers(max_prompt, attention)
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

    convs = [Conversation(row) for row in rows]
    for conv in sorted(convs, key=lambda c: -len(c.todo)):  # stable: plan order within a count
        enqueue(conv)
    for tier, queue in zip(tiers, queues, strict=True):
        if queue:
            capacity = tier + gen.max_new_tokens
            started = time.perf_counter()
            engine = BatchedGreedy(gen.model, batch, capacity, tier, attention=attention)
            tier_stats = TierStats(tier, capacity, setup_s=time.perf_counter() - started)
            _drain(gen, engine, queue, end_turn, tier_stats, overlap)
            tier_stats.wall_s = time.perf_counter() - started
            if stats is not None:
                stats.append(tier_stats.summary(batch))
            del engine  # its caches and graphs, before the next tier's are allocated
    return n_tokens


def engine_tiers(max_prompt: int, attention: str) -> list[int]:
    """The static engines' prompt tiers: one under flex (`regenerate_continuous` says why)."""
    return [max_prompt] if attention == "flex" else prompt_tiers(max_prompt)


@dataclass
class TierStats:
    """Where one prompt tier's time went. A prefill returns its tokens to the host (a sync) and
    reading a step's tokens waits for the device, so the seconds around them are the device's;
    the host's own work runs beside a launched step and is the rest of `wall_s`. The first
    prefill and the first step (CUDA-graph capture, flex_attention's compile) count as setup."""

    tier: int
    capacity: int
    setup_s: float = 0.0
    turns: int = 0
    prefill_calls: int = 0
    prefill_s: float = 0.0
    steps: int = 0
    # waiting for a step's tokens (or, before a prefill, for the step in flight): the device's
    # share once the host's work is overlapped
    wait_s: float = 0.0
    busy_row_steps: int = 0
    # cache rows the busy rows' steps read (each its position + 1): the bandwidth roofline's KV
    kv_reads: int = 0
    wall_s: float = 0.0

    def summary(self, batch: int) -> dict:
        out = {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}
        busy = out.pop("busy_row_steps")
        # the share of the decode step's rows that held a sequence: the rest is the tier's
        # tail (and waits for a full prefill call), decoded for nothing
        out["busy_rows"] = round(busy / (self.steps * batch), 3) if self.steps else None
        return out


def _drain(
    gen: Generator,
    engine: BatchedGreedy,
    queue: deque,
    end_turn,
    stats: TierStats,
    overlap: bool = True,
) -> None:
    """Decode the queued (conversation, prompt) turns with every cache row kept busy; a turn
    ends at a stop token or max_new_tokens (`end_turn` may queue that conversation's next).

    With `overlap`, step k+1 is launched before step k's tokens are read, so the host's work on
    them (stop checks, decoding a finished turn, rendering the next turn's prompt) runs while
    the device computes. A row that finished at step k gets one more token from step k+1; it is
    dropped, since only rows still holding the turn they held at launch take a step's tokens.
    Each row's tokens are unchanged: its next input is already on the device."""
    # per cache row: the conversation, its turn's tokens so far, its prompt's length
    slots: list[tuple[Conversation, list[int], int] | None] = [None] * engine.batch
    freed: list[int] = []  # rows whose turn ended, sent back to 0 (`release`) before any refill

    def settle(slot: int) -> None:
        conv, tokens, _ = slots[slot]
        finished = tokens[-1] in gen.eos_ids
        if finished or len(tokens) >= gen.max_new_tokens:
            slots[slot] = None
            freed.append(slot)
            end_turn(conv, tokens, finished)

    def take_step(pending, owners) -> None:
        started = time.perf_counter()
        tokens = pending.get()
        waited = time.perf_counter() - started
        if stats.steps == 0:
            stats.setup_s += waited  # the first step captures its graph
        else:
            stats.wait_s += waited
        stats.steps += 1
        for slot, token in enumerate(tokens):
            if slots[slot] is not None and slots[slot] is owners[slot]:
                _, row_tokens, prompt = slots[slot]
                stats.busy_row_steps += 1  # a row whose token counts
                stats.kv_reads += prompt + len(row_tokens)
                row_tokens.append(token)
                settle(slot)
        release()

    def release() -> None:
        if freed:
            engine.release(freed)
            freed.clear()

    in_flight = None
    while queue or any(slots) or in_flight:
        free = [slot for slot, busy in enumerate(slots) if busy is None]
        head = [len(prompt) for _, prompt in islice(queue, engine.prefill_rows)]
        wanted = engine.prefill_count(head)
        # prefill in full calls while sequences are decoding; waiting a few steps for free rows
        # costs less than a call per prompt
        if free and wanted and (len(free) >= wanted or not any(slots)):
            take = free[:wanted]
            turns = [queue.popleft() for _ in take]
            started = time.perf_counter()
            if in_flight is not None:  # the prefill would wait for it: count that as waiting
                in_flight[0].wait()
                stats.wait_s += time.perf_counter() - started
                started = time.perf_counter()
            firsts = engine.prefill(take, [prompt for _, prompt in turns])
            seconds = time.perf_counter() - started
            if stats.prefill_calls == 0:
                stats.setup_s += seconds
            else:
                stats.prefill_s += seconds
            stats.prefill_calls += 1
            stats.turns += len(take)
            for slot, (conv, prompt), token in zip(take, turns, firsts, strict=True):
                slots[slot] = (conv, [token], len(prompt))
                settle(slot)
            release()
            continue
        launched = None
        if any(slots):
            first, started = engine.launched == 0, time.perf_counter()
            launched = (engine.launch_step(), list(slots))
            if first:  # captures the step's CUDA graph (and compiles flex_attention)
                stats.setup_s += time.perf_counter() - started
        if in_flight is not None:
            take_step(*in_flight)
        in_flight = launched
        if not overlap and in_flight is not None:
            take_step(*in_flight)
            in_flight = None
