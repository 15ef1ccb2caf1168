"""A killed regeneration resumes without losing or duplicating a row, and matches a clean run."""

import hashlib
import json
import signal
import subprocess
import sys
import time

import polars as pl
import pytest

from dflash.data.regenerate import in_shard

pytestmark = pytest.mark.slow


def config(engine: str, temperature: float = 0.0) -> str:
    # fp32: on a CPU, a process's first bf16 forwards round differently from its later ones
    # (the same batch gave other tokens as a process's first batch than as its second), so in
    # bf16 a resumed run can differ from an uninterrupted one there
    regen = {"max_new_tokens": 12, "batch_size": 2, "dtype": "float32", "engine": engine}
    regen |= {"temperature": temperature, "top_p": 0.95, "top_k": 0}
    return json.dumps({"seed": 7, "data": {"regenerate": regen}})


def regenerate(target, rows, out, workdir, engine="hf", temperature=0.0, **popen):
    cmd = [
        sys.executable,
        "-m",
        "dflash",
        "regenerate",
        "--config",
        config(engine, temperature),
        "--target",
        str(target),
        "--input",
        str(rows),
        "--output",
        str(out),
        "--workdir",
        str(workdir),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)


@pytest.mark.parametrize(
    "engine, part, temperature",
    # the static engine resumes alike at any temperature: its greedy run is the 0.8 one less draws
    [("hf", "batch", 0.0), ("static", "done", 0.8)],
)
def test_killed_run_resumes_without_loss_or_duplication(
    tiny_workflow, target_dir, tmp_path, engine, part, temperature
):
    """Greedy, and sampled at 0.8 (each row's stream keyed by the seed, its id and its turn):
    the resumed run writes the very bytes of the uninterrupted one."""
    rows = tiny_workflow.results / "data" / "expanded" / "train.parquet"
    assert pl.read_parquet(rows).height == 6  # three parts of two

    def start(out, workdir):
        return regenerate(target_dir, rows, out, workdir, engine, temperature)

    clean = start(tmp_path / "clean.parquet", tmp_path / "w1")
    assert clean.wait() == 0, clean.stderr.read()

    run = start(tmp_path / "resumed.parquet", tmp_path / "w2")
    deadline = time.time() + 300
    while not list((tmp_path / "w2").rglob(f"{part}-00000.jsonl")) and time.time() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    finished = sorted(p.name for p in (tmp_path / "w2").rglob(f"{part}-*.jsonl"))
    assert finished and len(finished) < 3, f"kill came too late to test resume: {finished}"
    assert not (tmp_path / "resumed.parquet").exists()

    resumed = start(tmp_path / "resumed.parquet", tmp_path / "w2")
    assert resumed.wait() == 0, resumed.stderr.read()
    a = pl.read_parquet(tmp_path / "clean.parquet")
    b = pl.read_parquet(tmp_path / "resumed.parquet")
    assert b["id"].n_unique() == b.height == 6
    assert a["id"].to_list() == pl.read_parquet(rows)["id"].to_list()
    assert a.equals(b)
    # The target really rewrote the answers: they differ from ShareGPT's originals.
    original = pl.read_parquet(rows)["conversations"].to_list()
    regenerated = a["conversations"].to_list()
    assert any(
        o[-1]["content"] != r[-1]["content"] for o, r in zip(original, regenerated, strict=True)
    )


def test_shards_partition_rows_by_id():
    ids = [hashlib.sha256(str(i).encode()).hexdigest()[:20] for i in range(300)]
    owners = [[s for s in range(3) if in_shard(i, s, 3)] for i in ids]
    assert all(len(o) == 1 for o in owners)
    assert {o[0] for o in owners} == {0, 1, 2}


def test_generated_ids_are_stored_and_match_the_text(tiny_workflow, tokenizer):
    frame = pl.read_parquet(tiny_workflow.results / "data/regenerated/train.parquet")
    stop = tokenizer.eos_token_id
    for row in frame.iter_rows(named=True):
        answers = [t["content"] for t in row["conversations"] if t["role"] == "assistant"]
        assert len(row["turn_token_ids"]) == len(answers)
        for ids, text in zip(row["turn_token_ids"], answers, strict=True):
            content = ids[:-1] if ids and ids[-1] == stop else ids
            assert tokenizer.decode(content, skip_special_tokens=True) == text
    tokenized = pl.read_parquet(tiny_workflow.results / "data/tokenized/train.parquet")
    uncut = tokenized.filter(pl.col("length") < 96)  # tiny.yaml max_length: not truncated
    assert uncut.height > 0
    for row in uncut.iter_rows(named=True):
        last = frame.filter(pl.col("id") == row["id"]).row(0, named=True)["turn_token_ids"][-1]
        assert row["input_ids"][-len(last) :] == last  # exactly as generated


@pytest.mark.parametrize(
    ("attention", "overlap", "temperature", "min_cap"),
    [("sdpa", False, 0.0, None), ("flex", True, 0.0, 4), ("flex", True, 1.0, None)],
)
def test_static_engine_regenerates_what_transformers_generate_does(
    target_dir, tiny_workflow, attention, overlap, temperature, min_cap, monkeypatch
):
    """fp32 greedy: the refilled static batch gives every turn of every conversation the same
    tokens as `generate` on padded batches, with fewer cache rows than conversations (so rows are
    refilled), turns in two prompt tiers (two cache sizes; flex: one cache, prompts packed into
    prefill calls), and a turn whose prompt
    fills max_prompt ending its conversation in both; with either decode-step attention (flex
    reads only each row's live key blocks), and with the host's work on a step's tokens run
    beside the next step (rows finished a step earlier must drop its tokens) or not; the
    per-tier accounting adds up. Sampled (temperature 1, top-k 20), every token is a keyed draw
    from its row's stream: the two engines, batching and refilling rows differently, draw the
    same answers, and not the greedy ones."""
    from dflash.data import tools
    from dflash.data.continuous import regenerate_continuous
    from dflash.data.expand import read_rows
    from dflash.data.generation import Generator, _prompt_ids, answer_cap, regenerate_batch
    from dflash.model.batched import KV_BLOCK, BatchedGreedy
    from dflash.model.sampling import Sampling, row_key

    # Prefill calls of 3 key blocks still pack 3 of these prompts each (flex); the GPU's
    # 8K-token calls cost 55 s of 2 CPU cores here, most of it padding.
    monkeypatch.setattr(BatchedGreedy, "PREFILL_TOKENS", 3 * KV_BLOCK)
    rows = read_rows(tiny_workflow.results / "data" / "expanded" / "train.parquet")
    rows += read_rows(tiny_workflow.results / "data" / "expanded" / "eval.parquet")
    assert sum(r["conversations"][-1]["role"] == "assistant" for r in rows) == len(rows)
    assert any(len(r["conversations"]) > 2 for r in rows)  # multi-turn rows are in
    sampling = Sampling(temperature, top_k=20)
    gen = Generator(target_dir, "float32", "cpu", 10, sampling, seed=3, min_cap=min_cap)
    # a bound far above any of these prompts: their full lengths
    full = [_prompt_ids(gen.tokenizer, r["conversations"][:-1], 1 << 20) for r in rows]
    prompt_lengths = sorted(map(len, full))
    max_prompt = prompt_lengths[-2]  # the longest last turn does not fit

    convs, hf_tokens = regenerate_batch(gen, rows, max_prompt)
    expected = {c.row["id"]: c.result() for c in convs}
    # (shorter answers leave later prompts short of max_prompt: a drop then is not sure)
    assert sum(c.dropped_turns for c in convs) >= (1 if min_cap is None else 0)
    assert any(len(c.turn_ids) > 1 for c in convs)  # a later turn answered after the first
    cut_short = 0  # data.regenerate.min_cap: each answer stops at its own drawn cap
    for c in convs:
        answered = [i for i, t in enumerate(c.row["conversations"])
                    if t["role"] == "assistant" and not tools.has_calls(t)]  # fmt: skip
        for turn, ids in zip(answered, c.turn_ids, strict=False):
            cap = answer_cap(row_key(3, c.row["id"], turn), 10, min_cap)
            assert len(ids) <= cap and (turn not in c.truncated or len(ids) == cap)
            cut_short += turn in c.truncated and cap < 10
    assert (cut_short > 0) == (min_cap is not None)

    got, stats = {}, []
    # sdpa: two caches, the second larger; flex: its default, one engine for every turn
    tiers = [prompt_lengths[len(rows) // 2], max_prompt] if attention == "sdpa" else None
    tokens = regenerate_continuous(
        gen, rows, max_prompt, lambda c: got.__setitem__(c.row["id"], c.result()), 3, tiers,
        attention=attention, stats=stats, overlap=overlap,
    )  # fmt: skip
    assert got == expected
    assert tokens == hf_tokens > 0
    if temperature:
        greedy, _ = regenerate_batch(Generator(target_dir, "float32", "cpu", 10), rows, max_prompt)
        assert [c.turn_ids for c in greedy] != [c.turn_ids for c in convs]
    assert [s["tier"] for s in stats] == (tiers or [max_prompt])
    assert sum(s["turns"] for s in stats) == sum(len(c.turn_ids) for c in convs)
    for s in stats:
        assert 0 < s["busy_rows"] <= 1 and s["steps"] > 0
        assert s["kv_reads"] > s["steps"]  # each busy row reads its prompt and answer so far
        assert s["setup_s"] + s["prefill_s"] + s["wait_s"] <= s["wall_s"] + 0.01


def test_turn_waves_regenerate_what_transformers_generate_does(target_dir, tiny_workflow):
    """The vLLM engine's conversation logic (`regenerate_batch` with `on_done`), driven here by transformers'
    `generate` on CPU in fp32, since vLLM needs a GPU: every conversation's turns come out as
    `regenerate_batch` gives them, later turns after the target's own answers, a turn whose
    prompt fills max_prompt ending its conversation, each conversation reported once when done."""
    from dflash.data.expand import read_rows
    from dflash.data.generation import Generator, _prompt_ids, regenerate_batch

    rows = read_rows(tiny_workflow.results / "data" / "expanded" / "train.parquet")
    rows += read_rows(tiny_workflow.results / "data" / "expanded" / "eval.parquet")
    gen = Generator(target_dir, "float32", "cpu", max_new_tokens=10)
    full = [_prompt_ids(gen.tokenizer, r["conversations"][:-1], 1 << 20) for r in rows]
    max_prompt = sorted(map(len, full))[-2]
    convs, hf_tokens = regenerate_batch(gen, rows, max_prompt)

    class Turns:  # VllmTurns' interface over the same model
        tokenizer, seed, template = gen.tokenizer, gen.seed, gen.template

        def generate(self, prompts, keys=None):
            return [gen.generate([p])[0] for p in prompts]  # one at a time: no padding

    got = {}

    def done(conv):
        assert conv.row["id"] not in got
        got[conv.row["id"]] = conv.result()

    _, tokens = regenerate_batch(Turns(), rows, max_prompt, done)
    assert got == {c.row["id"]: c.result() for c in convs}
    assert tokens == hf_tokens
    assert any(len(c.turn_ids) > 1 for c in convs) and sum(c.dropped_turns for c in convs) >= 1


def test_vllm_completions_read_as_our_engines_give_them():
    """A finished answer ends with its stop token whether vLLM returned it or only named it as
    the stop reason; an answer cut at max_new_tokens is not finished."""
    from types import SimpleNamespace

    from dflash.data.regen_vllm import finished_ids

    def done(ids, reason, stop=None):
        return SimpleNamespace(token_ids=ids, finish_reason=reason, stop_reason=stop)

    eos = [2, 7]
    assert finished_ids(done([5, 6, 7], "stop"), eos) == ([5, 6, 7], True)
    assert finished_ids(done([5, 6], "stop", stop=7), eos) == ([5, 6, 7], True)
    assert finished_ids(done([5, 6], "stop"), eos) == ([5, 6, 2], True)  # the EOS, unnamed
    assert finished_ids(done([5, 6, 9], "length"), eos) == ([5, 6, 9], False)


def test_the_vllm_engine_without_vllm_stops_with_a_clear_message(tiny_workflow, tmp_path):
    rows = tiny_workflow.results / "data" / "expanded" / "train.parquet"
    run = regenerate(tiny_workflow.target / "hf", rows, tmp_path / "out.parquet",
                     tmp_path / "w", engine="vllm")  # fmt: skip
    assert run.wait() != 0
    err = run.stderr.read().decode()
    assert "data.regenerate.engine: vllm" in err and "vLLM is not installed" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "w").exists()
