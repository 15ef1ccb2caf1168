import pytest

from dflash.data.normalize import BadRow, clean, conversation_id, to_turns

EXPECTED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def test_sharegpt_shape():
    record = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ],
    }
    assert to_turns(record) == EXPECTED


def test_openai_shape_with_text_parts():
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}],
            },
            {"role": "assistant", "content": "Hello!"},
        ]
    }
    assert to_turns(record) == EXPECTED


def test_alpaca_shape():
    record = {"system": "Be brief.", "instruction": "Hi", "input": "", "output": "Hello!"}
    assert to_turns(record) == EXPECTED
    with_input = to_turns({"instruction": "Translate", "input": "chat", "output": "cat"})
    assert with_input[0] == {"role": "user", "content": "Translate\n\nchat"}


def test_same_conversation_same_id_across_shapes():
    a, _ = clean(to_turns({"instruction": "Hi", "output": "Hello!"}), None)
    b, _ = clean(
        to_turns(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                ]
            }
        ),
        None,
    )
    assert conversation_id(a) == conversation_id(b)
    assert conversation_id(a) != conversation_id(EXPECTED)


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversations": "nope"}, "wrong_shape"),
        ({"conversations": [{"from": "human"}]}, "missing_key"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role"),
        ({"text": "plain"}, "unknown_shape"),
        ({"instruction": "only"}, "missing_key"),
        ({"messages": [{"role": "user", "content": 3}]}, "wrong_shape"),
    ],
)
def test_malformed_shapes_name_the_reason(record, reason):
    with pytest.raises(BadRow) as err:
        to_turns(record)
    assert err.value.reason == reason


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "turns, reason",
    [
        ([], "empty"),
        ([user(" "), bot("")], "empty"),
        ([user("a"), bot(" ")], "no_assistant"),  # the blank answer is removed
        ([bot("a"), user("b")], "no_assistant"),  # the opener is dropped, b has no answer
        ([user("a"), {"role": "system", "content": "s"}, bot("c")], "bad_turn_order"),
        ([user("a")], "no_assistant"),
    ],
)
def test_clean_drop_reasons(turns, reason):
    with pytest.raises(BadRow) as err:
        clean(turns, None)
    assert err.value.reason == reason


def test_clean_keeps_first_rounds_and_drops_unanswered_tail():
    turns = [user("1"), bot("a"), user("2"), bot("b"), user("3")]
    assert clean(turns, None) == (turns[:4], [])
    assert clean(turns, 1) == (turns[:2], [])


@pytest.mark.parametrize(
    "turns, repaired, fixes",
    [
        (  # ShareGPT's commonest fault: the export starts with the assistant's reply
            [bot("hi"), user("q"), bot("a")],
            [user("q"), bot("a")],
            ["leading_assistant_dropped"],
        ),
        (
            [{"role": "system", "content": "s"}, bot("hi"), user("q"), bot("a")],
            [{"role": "system", "content": "s"}, user("q"), bot("a")],
            ["leading_assistant_dropped"],
        ),
        (  # a question sent in two messages, an answer split in two
            [user("q1"), user("q2"), bot("a1"), bot("a2"), user("r"), bot("b")],
            [user("q1\n\nq2"), bot("a1\n\na2"), user("r"), bot("b")],
            ["same_role_merged"],
        ),
        (  # a blank user turn between two answers: removed, the answers merged
            [user("q"), bot("a1"), user("  "), bot("a2")],
            [user("q"), bot("a1\n\na2")],
            ["blank_turn_removed", "same_role_merged"],
        ),
    ],
)
def test_repairs_are_made_and_named(turns, repaired, fixes):
    assert clean(turns, None) == (repaired, fixes)
