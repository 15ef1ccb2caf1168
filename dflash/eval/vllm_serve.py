"""One vLLM engine decoding the evaluation's prompts, in a process of its own (`python -m
dflash.eval.vllm_serve REQUEST OUTPUT`), for the `eval_vllm` stage (`dflash.eval.vllm_stage`).

A process per engine because vLLM does not hand its GPU memory back within a process: the target
alone and the target with the drafter each get a fresh one. `REQUEST` (JSON) names the target,
the drafter (absent: the target alone), the prompts (`EvalPrompt` fields), the stop tokens and
the sizes; `OUTPUT` gets, per prompt decoded alone (batch 1, later turns after the engine's own
answer, as the evaluation does), its prompt's and its answer's tokens, wall seconds and the
change of vLLM's own speculative-decoding counters over it; then tokens/s with the same prompts
in waves of each concurrency.

At a temperature (`sampling` in the request: temperature, top_p, top_k, seeds), each eval set's
prompts are sent together, one wave per turn, each request with a seed of its own, and the
counters' change over the set gives its pooled acceptance length (per prompt it would take a
batch-1 pass per seed). `draft_sample_method` chooses vLLM's draft rule (greedy: the drafter's
argmax; probabilistic: drafts drawn from the drafter's distribution). `prompts_alone: false`
skips the batch-1 pass and the concurrency waves (an engine kept for its sampled figures).
"""

from __future__ import annotations

import time

from dflash.eval.served import engine_main

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(metrics) -> dict:
    """vLLM's speculative-decoding counters from `LLM.get_metrics()`: drafting rounds, accepted
    draft tokens, and accepted tokens by draft position."""
    out = {"drafts": 0, "accepted": 0, "per_position": []}
    for m in metrics:
        if m.name == DRAFTS:
            out["drafts"] = int(m.value)
        elif m.name == ACCEPTED:
            out["accepted"] = int(m.value)
        elif m.name == PER_POSITION:
            out["per_position"] = [int(v) for v in m.values]
    return out


def difference(after: dict, before: dict) -> dict:
    """The counters' change over one request."""
    width = max(len(after["per_position"]), len(before["per_position"]))
    a, b = (c["per_position"] + [0] * (width - len(c["per_position"])) for c in (after, before))
    per_position = [x - y for x, y in zip(a, b, strict=True)]
    return {
        "drafts": after["drafts"] - before["drafts"],
        "accepted": after["accepted"] - before["accepted"],
        "per_position": per_position,
    }


def serve(request: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash.eval.sets import EvalPrompt
    from dflash.eval.setup import encode

    speculative = None
    if request.get("drafter"):
        speculative = {
            "method": "dflash",
            "model": request["drafter"],
            "num_speculative_tokens": request["block_size"] - 1,
        }
        if request.get("draft_sample_method"):
            speculative["draft_sample_method"] = request["draft_sample_method"]
    started = time.perf_counter()
    llm = LLM(
        model=request["target"],
        speculative_config=speculative,
        dtype=request["dtype"],
        seed=0,
        max_model_len=request["max_model_len"],
        gpu_memory_utilization=request["gpu_memory_utilization"],
        enable_prefix_caching=False,  # every prompt pays its own prefill, as in our evaluation
        disable_log_stats=False,  # the speculative-decoding counters
    )
    startup_s = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(request["target"])
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], stop_token_ids=request["eos_ids"]
    )

    def run(batch: list[list[int]]):
        return llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params,
                            use_tqdm=False)  # fmt: skip

    rows, encoded = [], []
    first_turns = [
        EvalPrompt(**{**p, "followups": tuple(p["followups"])}) for p in request["prompts"]
    ]
    template = request.get("chat_template_kwargs") or {}
    sampled_turns = [
        EvalPrompt(**{**p, "followups": tuple(p["followups"])})
        for p in request.get("sampling_prompts", request["prompts"])
    ]
    sampled = [
        _sampled_waves(llm, tokenizer, sampled_turns, spec, request, template)
        for spec in request.get("sampling", [])
    ]
    pending = first_turns if request.get("prompts_alone", True) else []
    while pending:
        answers = []
        for prompt in pending:
            ids = encode(tokenizer, prompt, template)
            before = counters(llm.get_metrics())
            t0 = time.perf_counter()
            (out,) = run([ids])
            seconds = time.perf_counter() - t0
            spec = difference(counters(llm.get_metrics()), before)
            completion = out.outputs[0]
            rows.append({"id": prompt.id, "set": prompt.set_name, "prompt_ids": ids,
                         "tokens": list(completion.token_ids), "seconds": seconds, **spec})  # fmt: skip
            encoded.append(ids)
            answers.append(completion.text)
        pending = [p.followup(a) for p, a in zip(pending, answers, strict=True) if p.followups]
    concurrency = {}
    for c in request["concurrency"] if rows else []:
        tokens, seconds = 0, 0.0
        for i in range(0, len(encoded), c):
            t0 = time.perf_counter()
            outs = run(encoded[i : i + c])
            seconds += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        concurrency[str(c)] = {"tokens": tokens, "seconds": round(seconds, 3),
                               "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
    import vllm

    return {"vllm": vllm.__version__, "startup_s": round(startup_s, 1), "prompts": rows,
            "concurrency": concurrency, "sampled": sampled}  # fmt: skip


def _sampled_waves(llm, tokenizer, first_turns, spec: dict, request: dict, template) -> dict:
    """One temperature: per seed and eval set, the set's prompts in one wave per turn (each
    request seeded), and the counters' change over the set."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash.eval.setup import encode

    per_seed = []
    for seed in range(spec["seeds"]):
        sets = {}
        for name in dict.fromkeys(p.set_name for p in first_turns):
            pending = [p for p in first_turns if p.set_name == name]
            before, tokens, wave = counters(llm.get_metrics()), 0, 0
            while pending:
                ids = [encode(tokenizer, p, template) for p in pending]
                params = [
                    SamplingParams(
                        temperature=spec["temperature"],
                        top_p=spec["top_p"],
                        top_k=spec["top_k"] or -1,
                        max_tokens=request["max_new_tokens"],
                        stop_token_ids=request["eos_ids"],
                        seed=1_000_003 * seed + 1_009 * wave + i,
                    )  # fmt: skip
                    for i in range(len(pending))
                ]
                outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params,
                                    use_tqdm=False)  # fmt: skip
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
                pending = [p.followup(o.outputs[0].text) for p, o in
                           zip(pending, outs, strict=True) if p.followups]  # fmt: skip
                wave += 1
            sets[name] = difference(counters(llm.get_metrics()), before) | {"tokens": tokens}
        per_seed.append(sets)
    return {**{k: spec[k] for k in ("temperature", "top_p", "top_k")}, "seeds": per_seed}


if __name__ == "__main__":
    engine_main(serve)
