"""Our exported drafter in the hands of the public DFlash clients, on a CPU in fp32:

- the DFlash authors' reference package (`dflash` 0.1.0 from PyPI), installed apart from ours
  (`pip install --no-deps --target` into a cache folder) and run in a subprocess where its
  `dflash` is the one imported, decodes our trained tiny drafter to exactly our evaluation's
  tokens; our τ and the reference's way of counting are printed side by side (`pytest -s`);
- the reference README's usage, `AutoModel.from_pretrained(dir, trust_remote_code=True)` then
  `.spec_generate(...)`, runs on our export through the modeling file written beside the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.eval.decode import DrafterProposer, generate
from dflash.eval.sessions import target_session
from dflash.eval.sets import held_out
from dflash.eval.setup import encode, eos_ids
from dflash.model.drafter import load_drafter
from dflash.model.target import load_target

REFERENCE = "dflash==0.1.0"
SCRIPT = Path(__file__).parent / "data" / "reference_decode.py"
MAX_NEW = 16  # two blocks of the tiny run's drafter (B = 8): seconds on a CPU
PROMPTS = 6  # the bar: identical tokens on at least 6 prompts
# pip's words for a network it cannot reach (then the test skips; any other failure fails it)
OFFLINE = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeout",
    "ProxyError",
    "Max retries exceeded",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: a 135M model gains nothing from a second one, and on a busy CPU
    OpenMP's waiting threads make every matmul many times slower (0.85 ms against 14 ms a
    linear layer of the tiny target, measured on the shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-tests"


@pytest.fixture(scope="module")
def reference_package() -> Path:
    """The reference installed into its own folder (no dependencies: it runs on our torch and
    transformers), once per machine; a half-finished install never takes the final name."""
    folder = cache_root() / REFERENCE.replace("==", "-")
    if (folder / "dflash" / "model.py").is_file():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp), REFERENCE]
    done = subprocess.run(
        [*cmd, "--disable-pip-version-check", "--no-input", "--timeout", "30", "--retries", "1"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        log = done.stdout + done.stderr
        if any(word in log for word in OFFLINE):
            pytest.skip(f"PyPI is unreachable, so {REFERENCE} cannot be installed: {log[-300:]}")
        raise AssertionError(f"pip could not install {REFERENCE}:\n{log[-3000:]}")
    try:
        tmp.rename(folder)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@pytest.fixture(scope="module")
def evaluation(tiny_workflow, target_dir, tokenizer) -> dict:
    """The tiny run's trained drafter decoded by our evaluation's own code (the session, the
    proposer and `generate` the eval stage uses), fp32, on the first user turns of the run's
    conversations (its training ones first: there the drafter accepts some drafts)."""
    tiny_workflow.run("train")
    expanded = tiny_workflow.results / "data" / "expanded"
    prompts = [*held_out(expanded / "train.parquet"), *held_out(expanded / "eval.parquet")]
    prompts = prompts[:PROMPTS]
    drafter_dir = tiny_workflow.results / "drafter"
    target = load_target(target_dir, dtype=torch.float32)
    drafter = load_drafter(drafter_dir).eval()
    session = target_session(target, drafter.config.target_layer_ids)
    proposer = DrafterProposer(drafter, target.get_input_embeddings(), target.lm_head.weight)
    stop = eos_ids(target_dir, tokenizer)
    encoded = [encode(tokenizer, p) for p in prompts]
    gens = [generate(session, proposer, ids, MAX_NEW, stop) for ids in encoded]
    return dict(drafter=drafter_dir, prompts=prompts, encoded=encoded, gens=gens, stop=sorted(stop))


def tau(rounds: list[int]) -> float:
    return sum(rounds) / len(rounds) if rounds else float("nan")


def test_the_reference_client_decodes_our_drafter_to_our_evaluations_tokens(
    evaluation, reference_package, target_dir, tmp_path
):
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "target": str(target_dir),
                "drafter": str(evaluation["drafter"]),
                "prompts": evaluation["encoded"],
                "max_new_tokens": MAX_NEW,
                "stop_token_ids": evaluation["stop"],
                "our_class_prompts": 2,  # the drop-in check needs the interface, not coverage
            }
        )
    )
    out = tmp_path / "reference.json"
    # only the reference's folder on the path, run from elsewhere: its `dflash` is imported
    env = {**os.environ, "PYTHONPATH": str(reference_package), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(job), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ref = json.loads(out.read_text())
    assert Path(ref["module"]).resolve().is_relative_to(reference_package.resolve())
    info = ref["loading_info"]
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    assert ref["our_class_name"].endswith("dflash.DFlashDraftModel")  # our modeling file

    gens = evaluation["gens"]
    assert len(gens) == len(ref["reference_class"]) == PROMPTS and len(ref["our_class"]) == 2
    for i, (gen, drop_in) in enumerate(zip(gens, ref["our_class"], strict=False)):
        assert drop_in["tokens"] == gen.tokens, f"prompt {i}, our class in the reference's loop"
    print(f"\n{'prompt':<8}{'tokens':>7}{'rounds':>8}{'ref rounds':>11}{'τ':>7}{'ref τ':>7}")
    for i, (gen, theirs) in enumerate(zip(gens, ref["reference_class"], strict=True)):
        assert theirs["tokens"] == gen.tokens, f"prompt {i}"
        rounds = theirs["acceptance_lengths"]
        print(
            f"{i:<8}{len(gen.tokens):>7}{gen.rounds:>8}{len(rounds):>11}"
            f"{tau(gen.accepted):>7.3f}{tau(rounds):>7.3f}"
        )
    ours = [a for g in gens for a in g.accepted]
    counted = [a for r in ref["reference_class"] for a in r["acceptance_lengths"]]
    print(f"pooled τ: ours {tau(ours):.3f}, the reference's counting {tau(counted):.3f}")
    assert tau(ours) > 1.0  # a trained drafter: drafts are really accepted, not only bonuses


def test_the_reference_readme_usage_runs_on_our_export(evaluation, target_dir):
    """The reference README's usage, as written there but for our paths, fp32 (the README's
    dtype="auto" would load our bf16 weights) and a CPU's max_new_tokens: transformers builds
    our class from the modeling file beside the weights, and its `spec_generate` commits our
    evaluation's tokens in our evaluation's rounds."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    model = AutoModel.from_pretrained(
        evaluation["drafter"], trust_remote_code=True, dtype=torch.float32
    ).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert [tokenizer.eos_token_id] == evaluation["stop"]  # the README's stop list is ours
    for prompt, encoded, gen in list(
        zip(evaluation["prompts"], evaluation["encoded"], evaluation["gens"], strict=True)
    )[:3]:  # the first three: two of them accept drafts
        text = tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, add_generation_prompt=True
        )
        model_inputs = tokenizer([text], return_tensors="pt")
        assert model_inputs["input_ids"][0].tolist() == encoded
        generate_ids = model.spec_generate(
            input_ids=model_inputs["input_ids"],
            max_new_tokens=MAX_NEW,
            temperature=0.0,
            target=target,
            stop_token_ids=[tokenizer.eos_token_id],
        )
        assert generate_ids[0].tolist() == encoded + gen.tokens
        assert model.acceptance_lengths == gen.accepted
    # sampling's accept/reject path: top_k=1 leaves one token per row, so it must commit the
    # greedy tokens (a draft the target would not pick is rejected, and the residual is its pick)
    sampled = model.spec_generate(
        target, torch.tensor([encoded]), MAX_NEW, [tokenizer.eos_token_id], 1.0, top_k=1
    )
    assert sampled[0].tolist() == encoded + gen.tokens
