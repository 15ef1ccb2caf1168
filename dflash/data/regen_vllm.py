"""Regeneration through vLLM (`data.regenerate.engine: vllm`): the same conversations, turn by
turn after the target's own earlier answers, with vLLM's scheduler and kernels doing the decoding.

Turns go in waves (`regenerate_batch`): every conversation's next assistant turn at once
(`LLM.generate` batches and schedules them itself, prefix caching reusing each conversation's
earlier turns), then the next turns of the conversations that have more. A conversation is saved as
soon as its last turn is answered, in the same `done-*.jsonl` parts as the static engine's, so a
killed run resumes without redoing it. Greedy in both engines, but not the same arithmetic: the
tokens agree with ours until a near tie (bf16) parts them; BENCHMARKS.md says how far they agree.
Sampled, each answer has vLLM's per-request seed from its stream key: reproducible in vLLM, but
not the same draws as our engines' (`keyed_sample`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from dflash.data.generation import answer_cap
from dflash.errors import UserError

log = logging.getLogger(__name__)

# what vLLM may take of the GPU it is given: the rest is for CUDA's context and our own process
GPU_MEMORY_UTILIZATION = 0.9


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "data.regenerate.engine: vllm, but vLLM is not installed here (`import vllm` "
            "fails). Install it (docs/serving.md says which version serves this project) or "
            "use engine: auto"
        )


class VllmTurns:
    """The target in vLLM, answering lists of prompts (token ids), greedily or sampled."""

    def __init__(
        self,
        target_dir: Path,
        dtype: str,
        max_new_tokens: int,
        max_model_len: int,
        sampling=None,
        seed: int = 0,
        min_cap: int | None = None,
    ):
        require_vllm()
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        from dflash.model.target import eos_ids

        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.eos_ids = sorted(eos_ids(target_dir, self.tokenizer))
        if not self.eos_ids:
            raise UserError(f"{target_dir}: the target defines no end-of-sequence token")
        self.max_new_tokens, self.min_cap = max_new_tokens, min_cap
        self.llm = LLM(
            model=str(target_dir),
            dtype="bfloat16" if dtype == "auto" else dtype,
            seed=0,
            max_model_len=max_model_len,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            enable_prefix_caching=True,  # a later turn's prompt starts with the earlier turns
        )
        self.seed, self.template = seed, {}
        s = sampling.as_dict() if sampling is not None else {"temperature": 0.0}
        top_k = s.get("top_k") or -1  # vLLM's "every token"

        def params(key: int | None = None, cap: int = max_new_tokens):
            return SamplingParams(temperature=s["temperature"], top_p=s.get("top_p", 1.0),
                                  top_k=top_k, seed=key, max_tokens=cap,
                                  stop_token_ids=self.eos_ids)  # fmt: skip

        self.params = params
        self.greedy = s["temperature"] == 0

    def generate(
        self, prompts: list[list[int]], keys: list[int] | None = None
    ) -> list[tuple[list[int], bool]]:
        """`Generator.generate`'s contract, for `regenerate_batch`. Per prompt: the ids as
        generated (the stop token included when it finished) and whether it finished before
        `max_new_tokens`; sampled, each with vLLM's seed from its stream key."""
        from vllm.inputs import TokensPrompt

        if keys is None:
            params = self.params()
        else:  # each answer's own cap (`answer_cap`), and its own seed where sampled
            params = [self.params(None if self.greedy else key % (1 << 63),
                                  answer_cap(key, self.max_new_tokens, self.min_cap))
                      for key in keys]  # fmt: skip
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                    params, use_tqdm=True)  # fmt: skip
        return [finished_ids(o.outputs[0], self.eos_ids) for o in outputs]


def finished_ids(completion, eos_ids: list[int]) -> tuple[list[int], bool]:
    """vLLM's completion as our engines give it: the stop token kept at the end of a finished
    answer (whether vLLM returned it or only named it in `stop_reason`)."""
    tokens = list(completion.token_ids)
    if completion.finish_reason != "stop":  # "length": cut at max_new_tokens
        return tokens, False
    if not tokens or tokens[-1] not in eos_ids:
        reason = completion.stop_reason
        tokens.append(reason if isinstance(reason, int) else eos_ids[0])
    return tokens, True


def visible_gpu(device) -> None:
    """vLLM takes the first visible GPU: make it the one this shard claimed."""
    if device.type == "cuda" and device.index is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[device.index]
