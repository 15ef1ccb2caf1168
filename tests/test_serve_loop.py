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
        rounds, accepted = 1 + len(ids) % 3, len(ids) % 7
        # one round accepts them all: the histogram is as long as that round's count + 1, so
        # its length differs between requests (a shorter one after a longer one: not padded)
        histogram = [rounds - 1, *[0] * (accepted - 1), 1] if accepted else [rounds]
        meta = {"completion_tokens": 1 + rounds + accepted, "spec_verify_ct": rounds,
                "spec_accept_length": (1 + rounds + accepted) / rounds,
                "spec_num_correct_drafts": accepted,
                "spec_correct_drafts_histogram": histogram}  # fmt: skip
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
        assert row["per_position"] == expected["per_position"]  # its own, not padded
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
    # the second turn carries that conversation's own sampled answer
    (first_a, _), ((second_a,), _) = engine.calls[0][0], engine.calls[1]
    assert f"echo {len(first_a)}" in qwen3_tokenizer.decode(second_a)
    for per_set in run["seeds"]:  # every seed decodes the same prompts, so the same counts
        for name, calls in (("chat", engine.calls[:2]), ("code", engine.calls[2:3])):
            want = [counts(AnsweringEngine.answer(ids)["meta_info"])
                    for batch, _ in calls for ids in batch]  # fmt: skip
            assert per_set[name]["drafts"] == sum(c["drafts"] for c in want)
            assert per_set[name]["accepted"] == sum(c["accepted"] for c in want)
        assert per_set["chat"]["tokens"] == 3 * 4 and per_set["code"]["tokens"] == 4


class FakeMetric:
    def __init__(self, name, value=0, values=()):
        self.name, self.value, self.values = name, value, list(values)


def test_vllms_adapter_reads_its_cumulative_counters_and_maps_the_sampling(
    qwen3_tokenizer, monkeypatch
):
    """`VllmEngine` over an object answering as vLLM 0.24's `LLM` does (generate, get_metrics)
    and stand-ins for the two vLLM classes it builds: each prompt's counts are the change of
    vLLM's counters over it, and the common sampling maps to vLLM's terms (top_k -1 for every
    token, the seed per request)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from dflash.eval.vllm_serve import ACCEPTED, DRAFTS, PER_POSITION, VllmEngine

    vllm, inputs = ModuleType("vllm"), ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kw: kw
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)

    class CountingLLM:
        def __init__(self):
            self.drafts = self.accepted = 0
            self.params: list[dict] = []
            self.prompts: list[list[int]] = []

        def generate(self, prompts, params, use_tqdm=True):
            assert use_tqdm is False and len(prompts) == len(params)
            self.params += params
            self.prompts += prompts
            outs = []
            for ids in prompts:
                self.drafts += len(ids) % 5 + 1
                self.accepted += len(ids) % 3
                out = SimpleNamespace(token_ids=(11, EOS), text=f"echo {len(ids)}")
                outs.append(SimpleNamespace(outputs=[out]))
            return outs

        def get_metrics(self):
            return [FakeMetric(DRAFTS, self.drafts), FakeMetric(ACCEPTED, self.accepted),
                    FakeMetric(PER_POSITION, values=[self.accepted, 0])]  # fmt: skip

    llm = CountingLLM()
    spec = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seeds": 1}
    out = decode(VllmEngine(llm), qwen3_tokenizer, request_of(PROMPTS, sampling=[spec]))
    for row in out["prompts"]:
        ids = row["prompt_ids"]
        assert (row["drafts"], row["accepted"]) == (len(ids) % 5 + 1, len(ids) % 3)
        assert row["tokens"] == [11, EOS]
    sampled, greedy = llm.params[:4], llm.params[4]
    assert [p["seed"] for p in sampled] == [0, 1, WAVE_STRIDE, 2]
    assert all(p["top_k"] == -1 and p["temperature"] == 1.0 for p in sampled)
    assert greedy == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16,
                      "stop_token_ids": [EOS], "seed": None}  # fmt: skip
    # the chat set's waves: its two first turns, then a's second turn
    chat, asked = out["sampled"][0]["seeds"][0]["chat"], llm.prompts[:3]
    assert chat["tokens"] == 3 * 2
    assert chat["drafts"] == sum(len(ids) % 5 + 1 for ids in asked)
