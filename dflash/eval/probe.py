"""The same fixed decoding steps timed inside every evaluation stage: a check of its own clock.

Two stages of one run decode the same prompts with the same code, yet on the H200 their rounds
have cost 5.5 and 2.7 ms (BENCHMARKS.md 2026-12-04, "the evaluation's clock on identical
prompts"). Once every method has decoded, a stage times three steps of fixed inputs and shapes: the target's
1-token and B-token verify forwards after a fixed prefix, and one drafter round. It times them on
the live sessions that decoded the methods (whatever cache sizes and CUDA graphs those left) and,
on a GPU, on a second pair of sessions of a fixed small cache that no method touches. The same
step must cost the same in both stages: where it does not, the live sessions alone slower points
at their cache size, both slower at the process. (The 2x was the cache size: steps attended over
the whole cache, which the acceptance stage's longer prompts had grown; now they read only the
rows up to their span, `dflash.eval.sessions.attended`.)
"""

from __future__ import annotations

import time

import torch

from dflash.eval.decode import DrafterProposer

# A prefix long enough for real attention work, short enough to cost well under a second
PREFIX = {"cuda": 512, "cpu": 64}
REPS = {"cuda": 20, "cpu": 3}
WARM = 3  # CUDA graph captures (and compiles of a new shape) happen in these


def _timed_ms(step, reps: int) -> float:
    """Milliseconds per call of `step`, each call ending in a host sync as a decoding round's
    does (it reads the verified tokens)."""
    for _ in range(WARM):
        step()
    started = time.perf_counter()
    for _ in range(reps):
        step()
    return round(1000 * (time.perf_counter() - started) / reps, 3)


def probe_steps(target, proposer: DrafterProposer, vocab_size: int) -> dict:
    """ms of a 1-token and a B-token verify forward and of one drafter round (B-1 drafts from B
    new context rows), each after the same seeded prefix; and the sessions' cache sizes."""
    kind = target.device.type if target.device.type in PREFIX else "cpu"
    block = proposer.block_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab_size, (PREFIX[kind],), generator=g).tolist()
    capacity = len(prefix) + 2 * block
    target.reset(capacity)  # grows the cache only when it is smaller
    _, features = target.forward(prefix)
    proposer.start(prefix, features, capacity)
    drafter = proposer.session
    drafter.draft_logits(prefix[-1], features)  # the prefix's own (eager) call

    def verify(n: int):
        def step():
            tokens, _ = target.forward(prefix[:n])
            int(tokens[-1])  # the round's host sync
            target.crop(len(prefix))

        return step

    def draft():
        drafter.length = len(prefix)
        int(drafter.draft_logits(prefix[-1], features[:block]).argmax(-1)[-1])

    return {
        "verify_1_ms": _timed_ms(verify(1), REPS[kind]),
        f"verify_{block}_ms": _timed_ms(verify(block), REPS[kind]),
        "drafter_round_ms": _timed_ms(draft, REPS[kind]),
        "target_cache_rows": _rows(target),
        "drafter_cache_rows": drafter.cache.capacity if drafter.cache is not None else None,
    }


def _rows(target) -> int | None:
    engine = getattr(target, "engine", None)  # StaticSession; transformers' cache grows freely
    return engine.capacity if engine is not None else None
