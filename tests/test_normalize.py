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
    a = clean(to_turns({"instruction": "Hi", "output": "Hello!"}), None)
    b = clean(
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
        ([user("a"), bot(" ")], "empty_turn"),
        ([bot("a"), user("b")], "bad_turn_order"),
        ([user("a"), user("b"), bot("c")], "bad_turn_order"),
        ([user("a")], "no_assistant"),
    ],
)
def test_clean_drop_reasons(turns, reason):
    with pytest.raises(BadRow) as err:
        clean(turns, None)
    assert err.value.reason == reason


def test_clean_keeps_first_rounds_and_drops_unanswered_tail():
    turns = [user("1"), bot("a"), user("2"), bot("b"), user("3")]
    assert clean(turns, None) == turns[:4]
    assert clean(turns, 1) == turns[:2]
