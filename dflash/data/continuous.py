"""Regeneration through the static engine (`BatchedGreedy`): every cache row kept busy, a row
whose turn ends taking the same conversation's next turn or the next conversation at once, and
where the time went, per prompt tier."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from dataclasses import asdict, dataclass
from itertools import islice

from dflash.data.generation import Conversation, Generator
from dflash.data.tiers import prompt_tiers
from dflash.model.batched import BatchedGreedy


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
        prompt = conv.prompt(gen.tokenizer, max_prompt, gen.template)
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
            engine = BatchedGreedy(
                gen.model, batch, capacity, tier, attention=attention, sampling=gen.sampling
            )
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
    # per cache row: the conversation, its turn's tokens so far, its prompt's length, its cap
    slots: list[tuple[Conversation, list[int], int, int] | None] = [None] * engine.batch
    freed: list[int] = []  # rows whose turn ended, sent back to 0 (`release`) before any refill

    def settle(slot: int) -> None:
        conv, tokens, _, cap = slots[slot]
        finished = tokens[-1] in gen.eos_ids
        if finished or len(tokens) >= cap:
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
                _, row_tokens, prompt, _ = slots[slot]
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
            keys = [conv.key(gen.seed) for conv, _ in turns]
            firsts = engine.prefill(take, [prompt for _, prompt in turns], keys)
            seconds = time.perf_counter() - started
            if stats.prefill_calls == 0:
                stats.setup_s += seconds
            else:
                stats.prefill_s += seconds
            stats.prefill_calls += 1
            stats.turns += len(take)
            for slot, (conv, prompt), token, key in zip(take, turns, firsts, keys, strict=True):
                slots[slot] = (conv, [token], len(prompt), gen.cap(key))
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
