"""The decoding both serve modules share (`dflash.eval.serve_loop.decode`), driven through
SGLang's adapter over an engine object that answers as `sglang.Engine.generate` does (meta_info
shaped as SGLang 0.5.17 returns it, as in test_sglang_stage): SGLang and vLLM need a GPU and are
not installed here. What it pins is the loop itself: later turns after the engine's own answer,
each prompt's counts read as the change over it, seeds distinct per request, wave and seed, and
the concurrency waves' token counts. Qwen3's real tokenizer renders the prompts."""

from __future__ import annotations

from dataclasses import asdict

from dflash.eval.serve_loop import SEED_STRIDE, WAVE_STRIDE, decode
from dflash.eval.sets import EvalPrompt
from dflash.eval.sglang_serve import SglangEngine, counts

EOS = 7


class AnsweringEngine:
    """Answers every request with four tokens (the stop token last) and a text naming the
    request's length; its verify rounds and accepted drafts grow with the prompt's length, so
    each request's counts differ."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], list[dict]]] = []

    def generate(self, input_ids, sampling_params):
        assert isinstance(input_ids[0], list), "the adapter sends a batch, also of one"
        self.calls.append((input_ids, sampling_params))
        return [self.answer(ids) for ids in input_ids]

    @staticmethod
    def answer(ids: list[int]) -> dict:
        rounds, accepted = 1 + len(ids) % 3, len(ids) % 2
        meta = {"completion_tokens": 1 + rounds + accepted, "spec_verify_ct": rounds,
                "spec_accept_length": (1 + rounds + accepted) / rounds,
                "spec_num_correct_drafts": accepted,
                "spec_correct_drafts_histogram": [rounds - accepted, accepted]}  # fmt: skip
        return {"output_ids": [11, 12, 13, EOS], "text": f"echo {len(ids)}", "meta_info": meta}


def request_of(prompts: list[EvalPrompt], **more) -> dict:
    return {"prompts": [asdict(p) for p in prompts], "sampling_prompts": [asdict(p) for p in prompts],
            "max_new_tokens": 16, "eos_ids": [EOS], "concurrency": [2], **more}  # fmt: skip


PROMPTS = [
    EvalPrompt("chat", "a", [{"role": "user", "content": "Name a colour."}], ("And another?",)),
    EvalPrompt("chat", "b", [{"role": "user", "content": "Count to three."}]),
    EvalPrompt("code", "c", [{"role": "user", "content": "Write hello world in C."}]),
]


def test_each_prompt_alone_then_its_next_turn_after_the_engines_own_answer(qwen3_tokenizer):
    engine = AnsweringEngine()
    out = decode(SglangEngine(engine), qwen3_tokenizer, request_of(PROMPTS))
    rows = out["prompts"]
    assert [r["id"] for r in rows] == ["a", "b", "c", "a#turn2"]
    first, second = rows[0], rows[3]
    # the second turn carries the engine's first answer, then the follow-up
    second_text = qwen3_tokenizer.decode(second["prompt_ids"])
    assert f"echo {len(first['prompt_ids'])}" in second_text and "And another?" in second_text
    for row in rows:  # each row's counts are its own request's, not the running total
        expected = counts(AnsweringEngine.answer(row["prompt_ids"])["meta_info"])
        assert (row["drafts"], row["accepted"]) == (expected["drafts"], expected["accepted"])
        assert row["sglang_accept_length"] == expected["sglang_accept_length"]
        assert row["tokens"] == [11, 12, 13, EOS]
    alone = [params for batch, params in engine.calls if len(batch) == 1][:4]
    assert all(p == [{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16,
                      "stop_token_ids": [EOS]}] for p in alone)  # fmt: skip
    # the concurrency waves: the four prompts decoded alone, two at a time
    assert out["concurrency"]["2"]["tokens"] == 4 * 4
    assert [len(b) for b, _ in engine.calls[4:]] == [2, 2]
    assert out["sampled"] == []


def test_sampled_waves_seed_every_request_apart_and_count_each_set(qwen3_tokenizer):
    engine = AnsweringEngine()
    spec = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seeds": 2}
    request = request_of(PROMPTS, sampling=[spec], prompts_alone=False)
    out = decode(SglangEngine(engine), qwen3_tokenizer, request)
    assert out["prompts"] == [] and out["concurrency"] == {}
    (run,) = out["sampled"]
    assert (run["temperature"], run["top_p"], run["top_k"]) == (0.7, 0.9, 20)
    # per seed: chat's two prompts (and a's second turn in a wave of its own), then code's one
    assert [len(batch) for batch, _ in engine.calls] == [2, 1, 1] * 2
    seeds = [p["sampling_seed"] for _, params in engine.calls for p in params]
    assert len(set(seeds)) == len(seeds)
    assert seeds[:4] == [0, 1, WAVE_STRIDE, 2] and seeds[4] == SEED_STRIDE
    assert all(p["temperature"] == 0.7 and p["top_k"] == 20 for _, ps in engine.calls for p in ps)
    for per_set in run["seeds"]:
        chat = [ids for batch, _ in engine.calls[:2] for ids in batch]
        want = [counts(AnsweringEngine.answer(ids)["meta_info"]) for ids in chat]
        assert per_set["chat"]["drafts"] == sum(c["drafts"] for c in want)
        assert per_set["chat"]["accepted"] == sum(c["accepted"] for c in want)
        assert per_set["chat"]["tokens"] == 3 * 4 and per_set["code"]["tokens"] == 4
