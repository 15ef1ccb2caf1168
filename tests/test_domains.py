"""Training data by domain: the classifier's labels, the mixture's caps, the expand report's
counts per domain and prompt-only sources, through the real CLI."""

import gzip
import json
import subprocess
import sys

import polars as pl
import pytest

from dflash.data.domains import cap_rows, classify


def chat(*texts):
    roles = ["user", "assistant"] * len(texts)
    return [{"role": r, "content": t} for r, t in zip(roles, texts, strict=False)]


@pytest.mark.parametrize(
    "turns, domain",
    [
        (chat("Reverse a list?", "Use slicing:\n```python\nxs[::-1]\n```"), "code"),
        # no fence, but a program all the same
        (chat("What does this do?\nimport os\nimport sys\ndef f(x):\n    return os.sep"), "code"),
        (chat("Fix it:\npublic class A {\n  int x;\n}", "Add a semicolon."), "code"),
        (chat("Solve $x^2 - 4 = 0$.", "x = 2 or x = -2."), "math"),
        (chat("Simplify \\frac{6}{8}.", "3/4"), "math"),
        (chat("How many legs?", "23 * 4 = 92 and 14 * 4 = 56, so 92 + 56 = 148."), "math"),
        # prices are not math, a greeting is not code
        (chat("I have $100 and $250 to invest.", "Index funds are a start."), "chat"),
        (chat("Write a haiku about rain.", "Soft rain on the roof;\nthe street shines."), "chat"),
    ],
)
def test_classifier_labels_known_examples(turns, domain):
    assert classify(turns) == domain


def test_caps_keep_the_first_rows_of_each_domain_in_order():
    rows = [{"id": i, "domain": d} for i, d in enumerate("ccmcxmc")]
    kept, left_out = cap_rows(rows, {"c": 2, "m": None, "x": 0})
    assert [r["id"] for r in kept] == [0, 1, 2, 5]
    assert left_out == {"c": 2, "x": 1}


def write_jsonl(path, records, gz=False):
    data = "\n".join(json.dumps(r) for r in records).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def expand(tmp_path, config):
    cmd = [sys.executable, "-m", "dflash", "expand", "--config", json.dumps(config)]
    out = {k: tmp_path / f"{k}.{ext}" for k, ext in [("train", "parquet"), ("eval", "parquet")]}
    out["report"] = tmp_path / "report.json"
    args = [f"--{k}={v}" for k, v in out.items()]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=tmp_path), out


def test_a_mixture_expands_with_rows_counted_per_domain(tmp_path):
    """Chat rows (classified), a gzipped prompt-only math set and a labelled code file: the
    report counts each domain kept, trained on, held out and capped; the rows carry it."""
    chats = [
        {"messages": chat(f"Tell me about city {i}.", f"City {i} is nice.")} for i in range(6)
    ] + [{"messages": chat(f"Sort list {i}?", "```python\nsorted(xs)\n```")} for i in range(3)]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    write_jsonl(tmp_path / "math.jsonl.gz", [{"q": f"What is {i} + {i}?"} for i in range(5)], True)
    write_jsonl(tmp_path / "code.jsonl", [{"instruction": "Print hi.", "output": "print('hi')"}])
    config = {
        "data": {
            "sources": [
                {"name": "chats", "path": "chats.jsonl"},
                {
                    "name": "gsm",
                    "path": "math.jsonl.gz",
                    "domain": "math",
                    "template": {"user": "{q}"},
                },
                {"name": "code", "path": "code.jsonl", "domain": "code"},
            ],
            "eval_rows": 2,
            "domain_rows": {"chat": 2},
        }
    }
    done, out = expand(tmp_path, config)
    assert done.returncode == 0, done.stderr
    report = json.loads(out["report"].read_text())
    assert report["sources"]["chats"]["domains"] == {"chat": 6, "code": 3}
    assert report["sources"]["gsm"]["domains"] == {"math": 5}
    domains = report["domains"]
    assert domains["rows"] == {"chat": 6, "code": 4, "math": 5}
    assert domains["train"]["chat"] == 2 and domains["capped"]["chat"] > 0
    held = sum(domains["eval"].values())
    assert held == 2 and sum(domains["train"].values()) == report["train_rows"]
    assert (
        domains["train"]["chat"] + domains["eval"].get("chat", 0) + domains["capped"]["chat"]
        == 6 - report["held_out_prompt_overlap"]
    )
    train = pl.read_parquet(out["train"])
    assert train.columns == ["id", "source", "domain", "conversations"]
    math = train.filter(pl.col("source") == "gsm").row(0, named=True)
    assert math["domain"] == "math" and math["conversations"][0]["content"].startswith("What is")


def test_a_template_field_missing_from_a_row_names_file_line_and_field(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"q": "a?"}, {"question": "b?"}])
    source = {"name": "p", "path": "p.jsonl", "template": {"user": "{q}"}}
    done, out = expand(tmp_path, {"data": {"sources": [source], "eval_rows": 0}})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "p.jsonl: line 2" in done.stderr and "the row has no 'q'" in done.stderr
    assert not out["train"].exists()


def test_held_out_rows_for_a_source_not_listed_name_the_key(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"q": "a?"}])
    source = {"name": "p", "path": "p.jsonl", "template": {"user": "{q}"}}
    done, out = expand(tmp_path, {"data": {"sources": [source], "eval_rows": {"sharegpt": 1}}})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "data.eval_rows.sharegpt: no source named 'sharegpt'" in done.stderr
    assert not out["train"].exists() and not out["report"].exists()


def test_held_out_counts_per_source_follow_the_sources_order_and_say_what_each_gave(tmp_path):
    """Keys in any order (the workflow passes them sorted): sources are drawn in data.sources
    order; a source short of rows holds out what it has, and the report and log say so."""
    write_jsonl(tmp_path / "b.jsonl", [{"q": f"Question {i}?"} for i in range(8)])
    write_jsonl(tmp_path / "a.jsonl", [{"q": "Only one?"}])
    sources = [
        {"name": "b", "path": "b.jsonl", "template": {"user": "{q}"}},
        {"name": "a", "path": "a.jsonl", "template": {"user": "{q}"}},
    ]
    config = {"data": {"sources": sources, "eval_rows": {"a": 3, "b": 2}}}
    done, out = expand(tmp_path, config)
    assert done.returncode == 0, done.stderr
    report = json.loads(out["report"].read_text())
    assert report["eval_rows_by_source"] == {"a": 1, "b": 2} and report["train_rows"] == 6
    assert "data.eval_rows.a asks 3 held-out rows, source 'a' gave 1" in done.stderr
    held = pl.read_parquet(out["eval"])["source"].to_list()
    assert held == ["b", "b", "a"]  # data.sources order, not the mapping's
