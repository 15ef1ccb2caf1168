"""A speculative output that parts from the target's own is judged at its first differing token:
a near tie is rounding in reduced precision, anything else (or anything in float32) is a bug."""

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.lossless import beyond, divergence, first_difference, judge, recheck_in_float32


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


@pytest.fixture
def rounded(model, tmp_path):
    """A bf16 target saved in its folder, its float32 upcast (the exact reference), and a run
    model whose runner-up logit was pushed down as rounding can: (folder, exact, run, prompt,
    reference tokens, runner-up, worst)."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    half.save_pretrained(tmp_path)  # bf16 on disk: float32 only when the recheck asks for it
    exact = copy.deepcopy(half).float()
    prompt = [3, 17, 42, 5]
    ref = greedy(exact, prompt, 1)
    logits = ranked_logits(exact, prompt)
    runner_up, worst = logits.argsort(descending=True)[1].item(), logits.argmin().item()
    run = copy.deepcopy(half)
    with torch.no_grad():  # the runner-up scores as the worst token does: a wide gap
        run.lm_head.weight[runner_up] = run.lm_head.weight[worst]
    return tmp_path, logits, run, prompt, ref, runner_up, worst


def test_a_bf16_gap_past_the_margin_is_measured_again_in_float32(rounded):
    """The judging forward rounds in bf16 too (2026-12-05: a gap of 1.0 on an H100, exact in
    float32). A gap past the margin is measured again by the target loaded in float32 from its
    folder, and judged by that; a token the target clearly did not pick stays a bug."""
    folder, exact, run, prompt, ref, runner_up, worst = rounded
    tie = divergence(run, "tie", prompt, ref, [runner_up])
    bug = divergence(run, "bug", prompt, ref, [worst])
    again = divergence(run, "tie", prompt, ref, [runner_up])  # another method, same place
    g32 = {"tie": (exact[ref[0]] - exact[runner_up]).item()}
    g32["bug"] = (exact[ref[0]] - exact[worst]).item()
    margin = (g32["tie"] + g32["bug"]) / 2
    assert beyond(tie, margin) and beyond(bug, margin)  # in the run's own dtype: both fail
    assert judge([tie], exact=False, margin=margin)[1] != []
    recheck_in_float32(folder, [(tie, prompt), (bug, prompt), (again, prompt)], run.device)
    assert tie.gap_float32 == pytest.approx(g32["tie"], abs=1e-4)
    assert bug.gap_float32 == pytest.approx(g32["bug"], abs=1e-4)
    assert again.gap_float32 == tie.gap_float32
    ties, real = judge([tie, bug], exact=False, margin=margin)
    assert [d["prompt"] for d in ties] == ["tie"] and [d["prompt"] for d in real] == ["bug"]
    assert judge([tie], exact=True, margin=margin)[0] == []  # float32 runs: no forgiveness


def test_the_stage_check_rechecks_in_float32_and_fails_only_on_a_real_mismatch(rounded, tmp_path):
    """eval's lossless check end to end: a bf16 divergence past the margin that float32 puts
    within it is a near tie in the record; one past it in float32 too fails the stage, with its
    evidence written beside the output."""
    from types import SimpleNamespace

    from dflash.errors import UserError
    from dflash.eval.decode import Generation
    from dflash.eval.run import _check_lossless

    folder, exact, run, prompt, ref, runner_up, worst = rounded
    margin = ((exact[ref[0]] - exact[runner_up]) + (exact[ref[0]] - exact[worst])).item() / 2
    setup = SimpleNamespace(
        model=run, embed=run.get_input_embeddings(), dtype=torch.bfloat16, target_path=folder,
        prompts=[SimpleNamespace(id="p0")], encoded=[prompt],
        config={"eval": {"tie_margin": margin}},
    )  # fmt: skip
    output = tmp_path / "out" / "acceptance.json"
    output.parent.mkdir()
    record: dict = {}
    gens = {"target": [Generation(ref)], "drafter": [Generation([runner_up])]}
    _check_lossless(setup, gens, record, output)
    (tie,) = record["near_ties"]["drafter"]
    assert tie["gap"] > margin >= tie["gap_float32"]
    gens["drafter"] = [Generation([worst])]
    with pytest.raises(UserError, match="differs from the target's greedy output"):
        _check_lossless(setup, gens, {}, output)
    (evidence,) = json.loads(output.with_suffix(".failed.json").read_text())["mismatches"][
        "drafter"
    ]
    assert evidence["speculative"] == worst and evidence["context"] == prompt


def test_without_host_memory_for_a_float32_copy_the_runs_own_gap_judges(
    rounded, monkeypatch, caplog
):
    """The float32 copy needs 4 bytes a parameter in host memory: where that is not available the
    recheck says so and leaves the divergence to its own gap (a failure), never a crash."""
    import dflash.model.memory

    folder, exact, run, prompt, ref, runner_up, worst = rounded
    tie = divergence(run, "tie", prompt, ref, [runner_up])
    monkeypatch.setattr(dflash.model.memory, "host_available", lambda: 1000)
    with caplog.at_level("WARNING"):
        recheck_in_float32(folder, [(tie, prompt)], run.device)
    assert tie.gap_float32 is None
    assert "not measured again in float32" in caplog.text and "host memory" in caplog.text
