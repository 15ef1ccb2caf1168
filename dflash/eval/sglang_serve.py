"""One SGLang engine decoding the evaluation's prompts, in a process of its own (`python -m
dflash.eval.sglang_serve REQUEST OUTPUT`), for the `eval_sglang` stage (`dflash.eval.sglang_stage`).

A process per engine, as for vLLM: the target alone and the target with the drafter each get a
fresh one, and the stage puts SGLang's own packages first on this process's path alone. The
engine is SGLang's offline `sglang.Engine` with its DFlash worker (`speculative_algorithm=
"DFLASH"`, the drafter folder as `speculative_draft_model_path`, the block size as
`speculative_num_draft_tokens`); `REQUEST` and `OUTPUT` are those of `dflash.eval.vllm_serve`.

The counts come from each request's `meta_info` (SGLang 0.5.17, `managers/tokenizer_manager.py`):
`completion_tokens` (the answer's tokens through its stop token, none past max_new_tokens; the
first is the prompt's own forward's) and `spec_verify_ct` (verify rounds, one per decode step
that committed tokens to the request, `scheduler_components/batch_result_processor.py`; the
prefill is not one). SGLang's own `spec_accept_length` is completion_tokens / spec_verify_ct, so
it counts the prefill's token among the rounds' tokens; our τ counts the tokens committed per
verify round after the prompt's forward, (completion_tokens - 1) / spec_verify_ct, which is what
`counts` hands the stage (as drafts = rounds, accepted = committed - rounds). SGLang's own figure
and its count of correct drafts (which counts drafts past the stop token or the limit too) are
kept beside it. At a temperature, `sampling_seed` is sent with each request, but SGLang draws
from it only under `enable_deterministic_inference`, which this engine leaves off: the seeds are
independent draws, not reproducible streams.
"""

from __future__ import annotations

import time

from dflash.eval.served import engine_main

# what SGLang resolved for itself, kept for the record
RESOLVED = ("attention_backend", "speculative_draft_attention_backend",
            "speculative_num_draft_tokens", "max_running_requests", "mem_fraction_static")  # fmt: skip


def counts(meta: dict) -> dict:
    """One request's verify rounds and the tokens they committed, from SGLang's meta_info (no
    `spec_*` fields: no verify round, as for the target alone or an answer done at the prefill)."""
    rounds = int(meta.get("spec_verify_ct") or 0)
    completion = int(meta["completion_tokens"])
    committed = completion - 1 if rounds else 0  # the first token is the prefill's
    # rounds by how many drafts they accepted (its length grows with the most accepted) ->
    # rounds whose draft at position k (1-based) was accepted
    histogram = list(meta.get("spec_correct_drafts_histogram") or [])
    return {
        "drafts": rounds,
        "accepted": committed - rounds,
        "per_position": [sum(histogram[k:]) for k in range(1, len(histogram))],
        "completion_tokens": completion,
        "correct_drafts": int(meta.get("spec_num_correct_drafts") or 0),
        "sglang_accept_length": meta.get("spec_accept_length"),
    }


def engine_args(request: dict) -> dict:
    """`sglang.Engine`'s keyword arguments (ServerArgs fields of SGLang 0.5.17)."""
    args = {
        "model_path": request["target"],
        "dtype": request["dtype"],
        "random_seed": 0,
        "context_length": request["context_length"],
        "mem_fraction_static": request["mem_fraction_static"],
        "disable_radix_cache": True,  # every prompt pays its own prefill, as in our evaluation
        "log_level": "info",
    }
    if request.get("drafter"):
        args |= {
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": request["drafter"],
            "speculative_num_draft_tokens": request["block_size"],
        }
    return args


def greedy_params(request: dict) -> dict:
    return {"temperature": 0.0, "max_new_tokens": request["max_new_tokens"],
            "stop_token_ids": request["eos_ids"]}  # fmt: skip


def serve(request: dict) -> dict:
    import sglang
    from transformers import AutoTokenizer

    from dflash.eval.sets import EvalPrompt
    from dflash.eval.setup import encode

    started = time.perf_counter()
    engine = sglang.Engine(**engine_args(request))
    startup_s = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(request["target"])
    template = request.get("chat_template_kwargs") or {}

    def turns(key):
        return [EvalPrompt(**{**p, "followups": tuple(p["followups"])}) for p in request[key]]

    sampled = [
        _sampled_waves(engine, tokenizer, turns("sampling_prompts"), spec, request, template)
        for spec in request.get("sampling", [])
    ]
    rows, encoded = [], []
    pending = turns("prompts") if request.get("prompts_alone", True) else []
    while pending:
        answers = []
        for prompt in pending:
            ids = encode(tokenizer, prompt, template)
            t0 = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params=greedy_params(request))
            seconds = time.perf_counter() - t0
            rows.append({"id": prompt.id, "set": prompt.set_name, "prompt_ids": ids,
                         "tokens": list(out["output_ids"]), "seconds": seconds,
                         **counts(out["meta_info"])})  # fmt: skip
            encoded.append(ids)
            answers.append(out["text"])
        pending = [p.followup(a) for p, a in zip(pending, answers, strict=True) if p.followups]
    concurrency = {}
    for c in request["concurrency"] if rows else []:
        tokens, seconds = 0, 0.0
        for i in range(0, len(encoded), c):
            batch = encoded[i : i + c]
            t0 = time.perf_counter()
            params = [greedy_params(request)] * len(batch)
            outs = engine.generate(input_ids=batch, sampling_params=params)
            seconds += time.perf_counter() - t0
            tokens += sum(len(o["output_ids"]) for o in outs)
        concurrency[str(c)] = {"tokens": tokens, "seconds": round(seconds, 3),
                               "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
    resolved = {k: getattr(getattr(engine, "server_args", None), k, None) for k in RESOLVED}
    engine.shutdown()
    return {"sglang": sglang.__version__, "startup_s": round(startup_s, 1), "prompts": rows,
            "concurrency": concurrency, "sampled": sampled, "server_args": resolved,
            "sampling_verify": _sampling_verify() if request.get("drafter") else None}  # fmt: skip


def _sampling_verify() -> bool | None:
    """Whether SGLang's DFlash worker verifies sampled requests by speculative sampling; without
    its sgl_kernel sampling ops it falls back to greedy verification with a warning (None: a
    build without this function, so not known)."""
    try:
        from sglang.srt.speculative.dflash_utils import is_dflash_sampling_verify_available
    except ImportError:
        return None
    return bool(is_dflash_sampling_verify_available())


def _sampled_waves(engine, tokenizer, first_turns, spec: dict, request: dict, template) -> dict:
    """One temperature: per seed and eval set, the set's prompts in one wave per turn, and the
    counts summed over the set's requests."""
    from dflash.eval.setup import encode

    per_seed = []
    for seed in range(spec["seeds"]):
        sets = {}
        for name in dict.fromkeys(p.set_name for p in first_turns):
            pending, total, wave = [p for p in first_turns if p.set_name == name], [], 0
            while pending:
                ids = [encode(tokenizer, p, template) for p in pending]
                params = [
                    {"temperature": spec["temperature"], "top_p": spec["top_p"],
                     "top_k": spec["top_k"] or -1, "max_new_tokens": request["max_new_tokens"],
                     "stop_token_ids": request["eos_ids"],
                     "sampling_seed": 1_000_003 * seed + 1_009 * wave + i}
                    for i in range(len(pending))
                ]  # fmt: skip
                outs = engine.generate(input_ids=ids, sampling_params=params)
                total += [counts(o["meta_info"]) | {"tokens": len(o["output_ids"])} for o in outs]
                pending = [p.followup(o["text"]) for p, o in zip(pending, outs, strict=True)
                           if p.followups]  # fmt: skip
                wave += 1
            sets[name] = {k: sum(c[k] for c in total) for k in ("drafts", "accepted", "tokens")}
        per_seed.append(sets)
    return {**{k: spec[k] for k in ("temperature", "top_p", "top_k")}, "seeds": per_seed}


if __name__ == "__main__":
    engine_main(serve)
