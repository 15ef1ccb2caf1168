"""One vLLM engine decoding the evaluation's prompts, in a process of its own (`python -m
dflash.eval.vllm_serve REQUEST OUTPUT`), for the `eval_vllm` stage (`dflash.eval.vllm_stage`).

A process per engine because vLLM does not hand its GPU memory back within a process: the target
alone and the target with the drafter each get a fresh one. `REQUEST` (JSON) names the target,
the drafter (absent: the target alone), the prompts (`EvalPrompt` fields), the stop tokens and
the sizes. What is decoded, and what `OUTPUT` gets, is `dflash.eval.serve_loop.decode`'s: each
prompt alone, the same prompts in waves of each concurrency, and at a temperature each eval
set's prompts in one wave per turn (per prompt it would take a batch-1 pass per seed). The
counts are vLLM's own speculative-decoding counters (`LLM.get_metrics()`), whose change over a
request or a set gives its figures. `draft_sample_method` chooses vLLM's draft rule (greedy: the
drafter's argmax; probabilistic: drafts drawn from the drafter's distribution). `prompts_alone:
false` skips the batch-1 pass and the concurrency waves (an engine kept for its sampled figures).
"""

from __future__ import annotations

import time

from dflash.eval.serve_loop import Answer, Sampling, decode
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


class VllmEngine:
    """`serve_loop.Engine` over vLLM's offline `LLM`: its counters are vLLM's own, cumulative."""

    def __init__(self, llm):
        self.llm = llm

    def generate(self, batch: list[list[int]], sampling: list[Sampling]) -> list[Answer]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                           max_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                           seed=s.seed)
            for s in sampling
        ]  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [Answer(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]

    def counters(self) -> dict:
        return counters(self.llm.get_metrics())


def serve(request: dict) -> dict:
    import vllm
    from transformers import AutoTokenizer

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
    llm = vllm.LLM(
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
    decoded = decode(VllmEngine(llm), tokenizer, request)
    return {"vllm": vllm.__version__, "startup_s": round(startup_s, 1), **decoded}


if __name__ == "__main__":
    engine_main(serve)
