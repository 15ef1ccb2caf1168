"""The run record, `results/MANIFEST.json`: sha256 of every declared output and of every input made
under resources/ (the converted target), plus what the run's numbers depend on (code,
environment, config, data, topology) and the numbers themselves
(training throughput per role, τ). `dflash verify` re-hashes against it; `dflash compare` diffs
two of them.

Two runs of the same code, config and environment on one host give identical records except
for the fields named in VOLATILE.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from dflash.custody import Mismatch, producers
from dflash.errors import UserError
from dflash.io import read_json, sha256_file, sha256_json, sha256_tree, write_json
from dflash.manifest import PACKAGE_ROOT, environment_record

log = logging.getLogger(__name__)

FORMAT = 1

# Fields that honestly differ between two identical runs, by exact name (dotted path into the
# record). Everything else must match.
VOLATILE = (
    # when and where the record was written
    "created",
    "host",
    # wall-clock measurements
    "train.throughput",
    "eval.speed",
    # files that embed wall-clock measurements (tokens/s, seconds, speedups) ...
    "artefacts.compile/warmup.json",
    "artefacts.train/metrics.jsonl",
    "artefacts.train/summary.json",
    "artefacts.eval/acceptance.json",
    "artefacts.eval/ddtree.json",
    "artefacts.eval/vllm.json",
    "artefacts.eval/sampling.json",
    "artefacts.eval/sglang.json",
    "artefacts.summary.md",
    "artefacts.report/throughput.png",
    "artefacts.report/ddtree.png",
    # ... and the stage manifests that hash those files
    "artefacts.manifests/warmup_compile.json",
    "artefacts.manifests/train.json",
    "artefacts.manifests/eval_acceptance.json",
    "artefacts.manifests/eval_ddtree.json",
    "artefacts.manifests/eval_vllm.json",
    "artefacts.manifests/eval_sampling.json",
    "artefacts.manifests/eval_sglang.json",
    "artefacts.manifests/report.json",
)

# Working state under results/ that no rule declares as an output: never recorded or verified.
UNDECLARED = ("logs", "checkpoints", "work", "compile-cache", "MANIFEST.json")

# The serving engines whose eval/ENGINE.json (eval_vllm, eval_sglang) the record summarises.
SERVED = ("vllm", "sglang")


# What every record holds and `verify` and `compare` read: anything without them is not a record.
REQUIRED = ("format", "code", "environment", "config", "artefacts")


def read_record(path: Path, command: str) -> dict:
    """A MANIFEST.json, or UserError naming it: cut short, emptied, or missing keys."""
    again = "`snakemake --cores all all` writes it again from the results."
    try:
        record = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{command}: {path} is not a run record: it is not valid JSON ({e}); it was cut short"
            f" or edited. {again}"
        ) from None
    if not isinstance(record, dict):
        raise UserError(f"{command}: {path} is not a run record: it holds no JSON object. {again}")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise UserError(
            f"{command}: {path} is not a run record: it lacks the key(s) {', '.join(missing)}."
            f" {again}"
        )
    inputs = record.get("inputs") or {}
    if not isinstance(record["artefacts"], dict) or not all(
        isinstance(e, dict) and isinstance(e.get("sha256"), dict) and "path" in e
        for e in (inputs.values() if isinstance(inputs, dict) else [None])
    ):
        raise UserError(
            f"{command}: {path} is not a run record: 'artefacts' must map files to sha256 and"
            f" each of 'inputs' hold a path and its files' sha256. {again}"
        )
    return record


def git_state(repo: Path) -> dict | None:
    """Commit and dirty flag of the checkout holding the package (None outside git)."""

    def git(*args):
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    if git("rev-parse", "--show-toplevel") != str(repo.resolve()):
        return None  # the package is not the root of its own checkout (e.g. an installed copy)
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def source_files(workflow_dir: Path | None) -> dict[str, str]:
    """sha256 of every package module and workflow file, keyed by path in the repository."""
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    root = PACKAGE_ROOT.parent
    hashes = {f.relative_to(root).as_posix(): sha256_file(f) for f in files}
    if workflow_dir is not None:
        for f in sorted(Path(workflow_dir).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                hashes[f"workflow/{f.relative_to(workflow_dir).as_posix()}"] = sha256_file(f)
    return hashes


def artefact_hashes(results: Path, paths: list[Path]) -> dict[str, str]:
    """sha256 of every file of the given outputs (folders expanded), keyed relative to results/."""
    hashes = {}
    for path in map(Path, paths):
        if not path.exists():
            raise UserError(f"record: declared output {path} does not exist")
        try:
            rel = path.resolve().relative_to(results.resolve())
        except ValueError:
            raise UserError(f"record: {path} is outside the results folder {results}") from None
        base = rel.parent if path.is_file() else rel  # sha256_tree keys a file by its name
        for name, digest in sha256_tree(path).items():
            hashes[(base / name).as_posix()] = digest
    return dict(sorted(hashes.items()))


def input_record(results: Path, folder: Path) -> dict:
    """An input of the run made under resources/ (the converted target): where it is, relative to
    the results folder unless given absolute (so `verify` finds it from anywhere), and the sha256
    of every file in it, keyed relative to it."""
    if not folder.is_dir():
        raise UserError(f"record: input folder {folder} does not exist")
    path = folder if folder.is_absolute() else Path(os.path.relpath(folder, results))
    return {"path": path.as_posix(), "sha256": sha256_tree(folder)}


def parse_inputs(specs: list[str]) -> dict[str, Path]:
    inputs = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not (sep and name and folder):
            raise UserError(f"record: --input takes NAME=DIR, got {spec!r}")
        inputs[name] = Path(folder)
    return inputs


def data_summary(stats: dict) -> dict:
    rows = max(stats["rows"], 1)
    return {
        "rows": stats["rows"],
        "tokens": stats["tokens"],
        "trainable_tokens": stats["trainable_tokens"],
        "length": stats["length"],
        "bucket_shares": {
            f"{b['lower']}-{b['upper']}": round(b["rows"] / rows, 4) for b in stats["buckets"]
        },
        "batches_per_epoch": stats["batches_per_epoch"],
    }


def train_summary(summary: dict, metrics: list[dict]) -> dict:
    last = metrics[-1] if metrics else {}
    topology = summary.get("topology", {})
    world = topology.get("targets", 0) + topology.get("drafters", 0) or 1
    throughput = {
        k: summary.get(k)
        for k in (
            "tokens_per_s",
            "drafter_capacity_tokens_per_s",
            "target_capacity_tokens_per_s",
            "drafter_wait_fraction",
            "target_blocked_fraction",
            "mean_queue_depth",
            "time_split",
            "launch_bound_fraction",
            "host_share",
            "bottleneck",
            "verdict",
            "host",
            "compile_s",
            "startup_s",
            "startup_split_s",
        )
    }
    throughput["tokens_per_s_per_process"] = round((summary.get("tokens_per_s") or 0) / world, 1)
    peaks = [d.get("peak_memory_gb") for m in metrics for d in m.get("drafters", [])]
    throughput["peak_memory_gb"] = max((p for p in peaks if p is not None), default=None)
    return {
        "result": {
            "steps": last.get("step", 0),
            "loss": last.get("loss"),
            "tau": last.get("tau"),
            **{
                key: next((m[key] for m in reversed(metrics) if key in m), None)
                for key in ("tau_sim", "tau_sim_first")
            },
        },
        "throughput": throughput,
    }


def eval_summary(
    acceptance: dict,
    ddtree: dict,
    vllm: dict | None = None,
    sampling: dict | None = None,
    sglang: dict | None = None,
) -> dict:
    methods = {"drafter": acceptance, **acceptance["baselines"]}
    trees = {f"{r['budget']}{'+lookup' if r.get('lookup') else ''}": r for r in ddtree["results"]}
    summary = {
        "quality": {
            "tau_macro": {name: m["tau_macro"] for name, m in methods.items()},
            "tau_pooled": {name: m["tau_pooled"] for name, m in methods.items()},
            "tau_sim": (acceptance.get("tau_sim") or {}).get("tau_sim"),
            "teacher_forced_tau": acceptance["teacher_forced_tau"],
            "ddtree_tau": {b: r["tau_macro"] for b, r in trees.items()},
            "lossless": min(acceptance["lossless"], ddtree["lossless"]),
            "n_prompts": acceptance["n_prompts"],
            # the text τ was measured on: the target's own greedy tokens, and its precision
            "reference_sha256": acceptance.get("reference_sha256"),
            "dtype": acceptance.get("dtype"),
        },
        "speed": {
            "tokens_per_s": {name: m["tokens_per_s"] for name, m in methods.items()},
            "speedup": {name: m["speedup"] for name, m in methods.items()},
            "ddtree_speedup": {b: r["speedup"] for b, r in trees.items()},
        },
    }
    if sampling:  # eval_sampling ran: τ at each temperature, per method and draft rule
        summary["quality"]["sampled_tau_macro"] = {
            run["label"]: {m: r["overall"]["tau_macro"] for m, r in run["methods"].items()}
            for run in sampling["runs"]
        }
    for engine, served in (("vllm", vllm), ("sglang", sglang)):
        if not served:
            continue
        quality = summary["quality"][engine] = {"version": served[engine]}
        if "acceptance_length" in served:  # not served at temperature only (eval.vllm.greedy)
            quality |= served["acceptance_length"]
            summary["speed"][f"{engine}_speedup"] = {
                c: s["speedup"] for c, s in served["tokens_per_s"].items()
            }
        if served.get("sampled"):  # at each temperature and draft rule, pooled, beside ours
            quality["sampled_pooled"] = {
                f"T={run['temperature']} {run['draft_rule']}": run[f"{engine}_pooled"]
                for run in served["sampled"]
            }
    return summary


def topology_summary(train: dict) -> dict:
    topology = train["topology"]
    return {
        **topology,
        "world": topology["targets"] + topology["drafters"],
        "nnodes": train["nnodes"],
        "device": train["device"],
    }


def result_summaries(
    results: Path, engines: tuple[str, ...] = SERVED, sampling: bool = True
) -> dict:
    """The data, train and eval sections of a record, for the outputs the folder holds (of the
    serving engines' eval/ENGINE.json, those of `engines` alone, and eval/sampling.json where
    `sampling`: not one left by an earlier config, where this run has no such stage)."""
    sections = {}
    if (stats := results / "data/stats/stats.json").exists():
        sections["data"] = data_summary(read_json(stats))
    if (summary := results / "train/summary.json").exists():
        lines = (results / "train/metrics.jsonl").read_text().splitlines()
        sections["train"] = train_summary(read_json(summary), [json.loads(x) for x in lines])
    acceptance, ddtree = results / "eval/acceptance.json", results / "eval/ddtree.json"
    if acceptance.exists() and ddtree.exists():
        served = {e: results / f"eval/{e}.json" for e in engines}
        sampled = results / "eval/sampling.json"
        sections["eval"] = eval_summary(
            read_json(acceptance),
            read_json(ddtree),
            sampling=read_json(sampled) if sampling and sampled.exists() else None,
            **{e: read_json(path) for e, path in served.items() if path.exists()},
        )
    return sections


def stage_records(
    results: Path, artefacts: dict[str, str], inputs: dict[str, Path] | None = None
) -> dict:
    """Each recorded rule's stage manifest (stale ones from other configs are not artefacts and
    are left out) and each input's (its folder's manifest.json), without what the record already
    holds once: output hashes, the environment; each stage keeps the names of the modules it ran,
    so `compare` can tell which edits could have touched training or evaluation."""
    manifests = {
        Path(rel).stem: results / rel
        for rel in artefacts
        if rel.startswith("manifests/") and rel.endswith(".json")
    }
    for name, folder in (inputs or {}).items():
        if (folder / "manifest.json").is_file():
            manifests[name] = folder / "manifest.json"
    volatile = [v.removeprefix("artefacts.") for v in VOLATILE if v.startswith("artefacts.")]
    stages = {}
    for name, path in sorted(manifests.items()):
        m = read_json(path)
        env = m.pop("environment", None) or {}
        m.pop("output_sha256", None)
        # a stage that reads a file of wall-clock figures: its hash is as volatile as the file
        for key, read in (m.get("inputs") or {}).items():
            if any(f"/{str(read)}".endswith(f"/{v}") for v in volatile):
                (m.get("input_sha256") or {}).pop(key, None)
        m["code_files"] = sorted(m.get("code_files") or {})
        m["environment_sha256"] = env.get("sha256")
        stages[name] = m
    return stages


def disagreements(results: Path, record: dict, inputs: dict[str, Path]) -> list[Mismatch]:
    """Files whose hash in the record differs from the one their stage recorded (read from
    the stage manifests the record holds and each input folder's manifest.json)."""
    hashes = {(results / rel).resolve(): d for rel, d in record["artefacts"].items()}
    manifests = [results / rel for rel in record["artefacts"] if rel.startswith("manifests/")]
    for name, folder in inputs.items():
        files = record["inputs"][name]["sha256"].items()
        hashes |= {(folder / rel).resolve(): d for rel, d in files}
        manifests.append(folder / "manifest.json")
    recorded, unreadable = producers(manifests)
    if unreadable:
        raise UserError(f"record: {', '.join(map(str, unreadable))}: not a readable stage manifest")
    # a recorded file the record did not hash: gone (moved aside as damaged, deleted), unless
    # it lies outside what the record covers
    return [
        Mismatch(path, digest, hashes.get(path), manifest)
        for path, (digest, manifest) in sorted(recorded.items())
        if hashes.get(path) != digest and (path in hashes or not path.exists())
    ]


def build_record(
    results: Path,
    config: dict,
    outputs: list[Path],
    workflow_dir: Path | None,
    inputs: dict[str, Path] | None = None,
):
    results, inputs = Path(results), inputs or {}
    made = set(map(Path, outputs))  # of the engines' records, only those this run declares
    engines = tuple(e for e in SERVED if results / f"eval/{e}.json" in made)
    files = source_files(workflow_dir)
    record = {
        "format": FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "git": git_state(PACKAGE_ROOT.parent),
        "code": {"sha256": sha256_json(files), "files": files},
        "environment": environment_record(),
        "config_sha256": sha256_json(config),
        "config": config,
        "topology": topology_summary(config["train"]),
        **result_summaries(results, engines, sampling=results / "eval/sampling.json" in made),
    }
    # what the run read, made once under resources/ for every run that names it
    record["inputs"] = {name: input_record(results, f) for name, f in sorted(inputs.items())}
    record["artefacts"] = artefact_hashes(results, outputs)
    if bad := disagreements(results, record, inputs):
        raise UserError(
            "record: refusing to record files that differ from what the stage that wrote them"
            " recorded: " + "; ".join(map(str, bad)) + ". They changed after their stage ran:"
            " rerun the workflow (Snakemake rebuilds a damaged output) or restore them; a missing"
            " file that no rule reads is made again by `snakemake --forcerun RULE all`."
        )
    record["stages"] = stage_records(results, record["artefacts"], inputs)
    return record


def run(args) -> None:
    inputs = parse_inputs(args.inputs)
    record = build_record(args.results, args.config, args.outputs, args.workflow_dir, inputs)
    write_json(args.output, record)
    log.info("record: %d artefacts -> %s", len(record["artefacts"]), args.output)
