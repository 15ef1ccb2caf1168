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

from dflash.eval.serve_loop import Answer, Sampling, add, decode, zero_counts
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


def sampling_params(s: Sampling) -> dict:
    params = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
              "max_new_tokens": s.max_new_tokens, "stop_token_ids": list(s.stop_token_ids)}  # fmt: skip
    return params if s.seed is None else params | {"sampling_seed": s.seed}


class SglangEngine:
    """`serve_loop.Engine` over `sglang.Engine`: SGLang reports counts per request, summed here
    into counters as vLLM keeps them; the rest of each request's meta_info goes with its answer."""

    def __init__(self, engine):
        self.engine = engine
        self.total = zero_counts()

    def generate(self, batch: list[list[int]], sampling: list[Sampling]) -> list[Answer]:
        params = [sampling_params(s) for s in sampling]
        outs = self.engine.generate(input_ids=batch, sampling_params=params)  # a list of lists:
        answers = []  # a batch, answered in order, also for one request
        for out in outs:
            request = counts(out["meta_info"])
            self.total = add(self.total, request)
            # its own per-position list (as long as its histogram), not the running total's
            extra = {k: v for k, v in request.items() if k not in ("drafts", "accepted")}
            answers.append(Answer(list(out["output_ids"]), out["text"], extra))
        return answers

    def counters(self) -> dict:
        return self.total


def serve(request: dict) -> dict:
    import sglang
    from transformers import AutoTokenizer

    started = time.perf_counter()
    engine = sglang.Engine(**engine_args(request))
    startup_s = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(request["target"])
    decoded = decode(SglangEngine(engine), tokenizer, request)
    resolved = {k: getattr(getattr(engine, "server_args", None), k, None) for k in RESOLVED}
    engine.shutdown()
    return {"sglang": sglang.__version__, "startup_s": round(startup_s, 1), **decoded,
            "server_args": resolved,
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


if __name__ == "__main__":
    engine_main(serve)
