"""What an engine's serve module decodes, engine-neutral: the prompts one at a time (later turns
after the engine's own answer), the same prompts in waves of each concurrency, and at each
temperature the eval sets' prompts in one wave per turn with a seed per request. vLLM's and
SGLang's serve modules (`dflash.eval.vllm_serve`, `dflash.eval.sglang_serve`) each wrap their
engine in the two methods `Engine` names and hand it to `decode`.

The counts are cumulative, as vLLM keeps them (`LLM.get_metrics()`): a request's (or a set's)
figures are the change over it. An engine that reports counts per request (SGLang's meta_info)
sums them itself, so both read alike here.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

# seeds of sampled requests: distinct per seed, wave (turn) and request, as eval_sampling's are
SEED_STRIDE, WAVE_STRIDE = 1_000_003, 1_009


@dataclass(frozen=True)
class Sampling:
    """One request's sampling, in the engines' common terms (top_k 0: every token)."""

    temperature: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class Answer:
    tokens: list[int]
    text: str
    extra: dict = field(default_factory=dict)  # what the engine reports of this request alone


class Engine(Protocol):
    def generate(self, batch: list[list[int]], sampling: list[Sampling]) -> list[Answer]: ...

    def counters(self) -> dict:
        """Cumulative `drafts` (verify rounds), `accepted` (draft tokens committed) and
        `per_position` (accepted tokens by draft position)."""
        ...


def zero_counts() -> dict:
    return {"drafts": 0, "accepted": 0, "per_position": []}


def _combined(a: dict, b: dict, sign: int) -> dict:
    """a + sign * b, count by count (per-position lists padded with zeros to the longer)."""
    pairs = itertools.zip_longest(a["per_position"], b["per_position"], fillvalue=0)
    return {"drafts": a["drafts"] + sign * b["drafts"],
            "accepted": a["accepted"] + sign * b["accepted"],
            "per_position": [x + sign * y for x, y in pairs]}  # fmt: skip


def add(total: dict, counts: dict) -> dict:
    """`total` plus one request's counts."""
    return _combined(total, counts, 1)


def difference(after: dict, before: dict) -> dict:
    """The counters' change over one request (or one set's requests)."""
    return _combined(after, before, -1)


def decode(engine: Engine, tokenizer, request: dict) -> dict:
    """The request's prompts through `engine`: `prompts` (one row per prompt decoded alone: its
    ids, the answer's tokens, wall seconds, the counters' change over it and what the engine
    reports of it), `concurrency` (tokens/s in waves of each size) and `sampled` (per
    temperature of `request["sampling"]`, per seed and eval set, the counters' change and the
    tokens)."""
    from dflash.eval.sets import EvalPrompt
    from dflash.eval.setup import encode

    template = request.get("chat_template_kwargs") or {}

    def first_turns(key: str) -> list[EvalPrompt]:
        prompts = request.get(key, request["prompts"])
        return [EvalPrompt(**{**p, "followups": tuple(p["followups"])}) for p in prompts]

    def ids_of(prompt: EvalPrompt) -> list[int]:
        return encode(tokenizer, prompt, template)

    greedy = Sampling(0.0, request["max_new_tokens"], tuple(request["eos_ids"]))
    sampled = [
        sampled_waves(engine, ids_of, first_turns("sampling_prompts"), spec, greedy)
        for spec in request.get("sampling", [])
    ]
    rows, encoded = [], []
    pending = first_turns("prompts") if request.get("prompts_alone", True) else []
    while pending:
        answers = []
        for prompt in pending:
            ids = ids_of(prompt)
            before = engine.counters()
            t0 = time.perf_counter()
            (answer,) = engine.generate([ids], [greedy])
            seconds = time.perf_counter() - t0
            rows.append({"id": prompt.id, "set": prompt.set_name, "prompt_ids": ids,
                         "tokens": answer.tokens, "seconds": seconds,
                         **difference(engine.counters(), before), **answer.extra})  # fmt: skip
            encoded.append(ids)
            answers.append(answer.text)
        pending = [p.followup(a) for p, a in zip(pending, answers, strict=True) if p.followups]
    concurrency = waves(engine, encoded, request["concurrency"], greedy) if rows else {}
    return {"prompts": rows, "concurrency": concurrency, "sampled": sampled}


def waves(engine: Engine, encoded: list[list[int]], sizes: list[int], greedy: Sampling) -> dict:
    """New tokens/s with the prompts sent `size` at a time, for each size."""
    out = {}
    for size in sizes:
        tokens, seconds = 0, 0.0
        for i in range(0, len(encoded), size):
            batch = encoded[i : i + size]
            t0 = time.perf_counter()
            answers = engine.generate(batch, [greedy] * len(batch))
            seconds += time.perf_counter() - t0
            tokens += sum(len(a.tokens) for a in answers)
        out[str(size)] = {"tokens": tokens, "seconds": round(seconds, 3),
                          "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
    return out


def sampled_waves(engine: Engine, ids_of, first_turns, spec: dict, greedy: Sampling) -> dict:
    """One temperature: per seed and eval set, the set's prompts in one wave per turn, and the
    counters' change over the set with its new tokens. Each request's seed is its own: from the
    seed's number, the turn and the conversation's place among all the sets' first turns."""
    per_seed = []
    for seed in range(spec["seeds"]):
        sets = {}
        for name in dict.fromkeys(p.set_name for p in first_turns):
            pending = [(i, p) for i, p in enumerate(first_turns) if p.set_name == name]
            before, tokens, wave = engine.counters(), 0, 0
            while pending:
                sampling = [
                    Sampling(spec["temperature"], greedy.max_new_tokens, greedy.stop_token_ids,
                             spec["top_p"], spec["top_k"], SEED_STRIDE * seed + WAVE_STRIDE * wave + i)
                    for i, _ in pending
                ]  # fmt: skip
                answers = engine.generate([ids_of(p) for _, p in pending], sampling)
                tokens += sum(len(a.tokens) for a in answers)
                pending = [(i, p.followup(a.text)) for (i, p), a in
                           zip(pending, answers, strict=True) if p.followups]  # fmt: skip
                wave += 1
            sets[name] = difference(engine.counters(), before) | {"tokens": tokens}
        per_seed.append(sets)
    return {**{k: spec[k] for k in ("temperature", "top_p", "top_k")}, "seeds": per_seed}
