"""Eval prompts found in the training rows (dflash/eval/overlap.py), on a hand-made train split
written as expand writes it."""

from dflash.data.expand import write_rows
from dflash.eval.overlap import found_in_training, overlap_text
from dflash.eval.sets import EvalPrompt

PROBLEM = (
    'def running_max(xs):\n    """Return a list whose i-th item is the largest of xs[0..i],'
    ' for a list of integers that may be empty."""'
)
TEMPLATE = "Write a Python function `main_solution` for this task.\n\n"


def conversation(*users):
    turns = []
    for text in users:
        turns += [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return turns


def user(text):
    return [{"role": "user", "content": text}]


def test_a_wrapped_problem_and_a_repeated_second_turn_are_found_a_shared_opening_is_not(tmp_path):
    train = tmp_path / "train.parquet"
    rows = [
        conversation("continue", PROBLEM.replace("    ", "\t")),  # reposted, other whitespace
        conversation(TEMPLATE + "Count the vowels of a word, ignoring case and accents."),
        conversation("Tell me about the ocean.", "Now answer in the voice of a pirate, please."),
    ]
    write_rows(
        [{"id": str(i), "source": "s", "conversations": c} for i, c in enumerate(rows)], train
    )
    prompts = [
        EvalPrompt("code", "wrapped", user(f"Complete this function:\n```python\n{PROBLEM}\n```")),
        EvalPrompt("code", "other", user(TEMPLATE + "Sort a list of words by their last letter.")),
        EvalPrompt("chat", "short", user("continue")),  # too short to say anything
        EvalPrompt(
            "chat",
            "81",
            user("Describe a harbour."),
            ("Now answer in the voice of a pirate, please.",),
        ),
        EvalPrompt("chat", "new", user("Describe a harbour at night in three sentences, please.")),
    ]
    found = found_in_training(prompts, train)
    assert found == {
        "code": {"prompts": 2, "found": ["wrapped"]},
        # each turn counted as the evaluation counts it: the second is 81#turn2
        "chat": {"prompts": 4, "found": ["81#turn2"]},
    }
    text = overlap_text(found)
    assert text.startswith("**Eval prompts in the training data:** code: 1 of 2 (wrapped); ")
    assert "chat: 1 of 4 (81#turn2) found in the training rows" in text
    clean = {"code": {"prompts": 2, "found": []}}
    assert "none of the 2 prompts" in overlap_text(clean) and overlap_text(None) is None
