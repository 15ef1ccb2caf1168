"""A speculative output that parts from the target's own is judged at its first differing token:
a near tie is rounding in reduced precision, anything else (or anything in float32) is a bug."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.lossless import divergence, first_difference, judge


@pytest.fixture(scope="module")
def model(small_decoder):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def ranked_logits(model, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([context])).logits[0, -1]


@pytest.mark.parametrize(
    "a,b,expected",
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0)],
)
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_the_gap_is_the_targets_logit_difference_at_the_first_differing_token(model):
    prompt = [3, 17, 42, 5]
    ref = greedy(model, prompt, 6)
    logits = ranked_logits(model, prompt + ref[:3])
    runner_up, worst = logits.argsort(descending=True)[1].item(), logits.argmin().item()
    got = ref[:3] + [runner_up, 9, 9]
    d = divergence(model, "p0", prompt, ref, got)
    assert (d.prompt, d.position, d.reference, d.speculative) == ("p0", 3, ref[3], runner_up)
    assert d.gap == pytest.approx((logits[ref[3]] - logits[runner_up]).item(), abs=1e-4)
    assert d.gap >= 0  # the reference took the argmax
    far = divergence(model, "p0", prompt, ref, ref[:3] + [worst])
    assert far.gap > d.gap
    assert divergence(model, "p0", prompt, ref, list(ref)) is None


def test_a_near_tie_is_forgiven_only_outside_float32(model):
    prompt = [3, 17, 42, 5]
    ref = greedy(model, prompt, 4)
    logits = ranked_logits(model, prompt + ref[:1])
    runner_up, worst = logits.argsort(descending=True)[1].item(), logits.argmin().item()
    tie = divergence(model, "tie", prompt, ref, ref[:1] + [runner_up])
    bug = divergence(model, "bug", prompt, ref, ref[:1] + [worst])
    margin = (tie.gap + bug.gap) / 2  # between the two, whatever the random weights
    ties, real = judge([tie, bug], exact=False, margin=margin)
    assert [d["prompt"] for d in ties] == ["tie"] and [d["prompt"] for d in real] == ["bug"]
    ties, real = judge([tie, bug], exact=True, margin=margin)
    assert ties == [] and [d["prompt"] for d in real] == ["tie", "bug"]


def test_an_output_that_stops_early_is_a_real_mismatch(model):
    (d,) = [divergence(model, "s", [1, 2], [7, 8, 9], [7, 8])]
    assert d.position == 2 and d.speculative is None and d.gap is None
    assert judge([d], exact=False, margin=100.0)[1] == [d.__dict__]
