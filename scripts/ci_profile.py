"""Where CI's CPU goes, per command and per test: every Python process of a venv logs its own CPU
seconds at exit (a .pth hook), and the log is summed by command (`dflash train`, a Snakemake
start, a torchrun agent, ...) and by the test that started it (PYTEST_CURRENT_TEST, which child
processes inherit). A command's 10th-percentile CPU times its count is its fixed cost (imports,
start-up), which more processes pay and no scheduling hides.

    python scripts/ci_profile.py install .venv /tmp/ci-cpu.jsonl   # hook the venv's Pythons
    .venv/bin/pytest -q                                            # or any run
    python scripts/ci_profile.py report /tmp/ci-cpu.jsonl
    python scripts/ci_profile.py uninstall .venv

Processes killed by a signal (the SIGKILL tests) log nothing; the pytest workers' own lines are
the tests that run in-process.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

HOOK = """import atexit, json, os, resource, sys, time
_t0 = time.time()
def _ci_cpu_log():
    r = resource.getrusage(resource.RUSAGE_SELF)
    line = {{"cpu": round(r.ru_utime + r.ru_stime, 2), "wall": round(time.time() - _t0, 2),
             "argv": sys.argv[:3], "test": os.environ.get("PYTEST_CURRENT_TEST", "")[:200]}}
    try:
        with open({log!r}, "a") as f:
            f.write(json.dumps(line) + "\\n")
    except OSError:
        pass
atexit.register(_ci_cpu_log)
"""


def site_packages(venv: Path) -> Path:
    code = "import site; print(site.getsitepackages()[0])"
    out = subprocess.run([venv / "bin/python", "-c", code], capture_output=True, text=True)
    return Path(out.stdout.strip())


def install(venv: Path, log: Path) -> None:
    site = site_packages(venv)
    (site / "_ci_cpu_log.py").write_text(HOOK.format(log=str(log)))
    (site / "zz_ci_cpu_log.pth").write_text("import _ci_cpu_log\n")
    print(f"every Python of {venv} now logs its CPU to {log}")


def uninstall(venv: Path) -> None:
    site = site_packages(venv)
    for name in ("_ci_cpu_log.py", "zz_ci_cpu_log.pth"):
        (site / name).unlink(missing_ok=True)


def command(argv: list[str]) -> str:
    """`dflash STAGE`, `snakemake`, or the script's name."""
    names = [a.rsplit("/", 1)[-1] for a in argv]
    if names[0] == "__main__.py":  # python -m PACKAGE: the package's own argv[0]
        package = argv[0].rsplit("/", 2)[-2]
        stage = names[1] if len(names) > 1 and not names[1].startswith("-") else ""
        return f"{package} {stage}" if package == "dflash" else package
    return names[0]


def report(log: Path, top: int = 30) -> None:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    by_command: dict[str, list[float]] = collections.defaultdict(list)
    by_test: dict[str, float] = collections.Counter()
    for r in rows:
        by_command[command(r["argv"])].append(r["cpu"])
        by_test[r["test"].split(" (")[0] or "(outside a test)"] += r["cpu"]
    total = sum(r["cpu"] for r in rows)
    fixed = 0.0
    print(f"{len(rows)} processes, {total / 60:.1f} CPU-min\n")
    print("| command | processes | CPU s | median s | fixed s (p10 x n) |\n|---|---|---|---|---|")
    for name, cpus in sorted(by_command.items(), key=lambda kv: -sum(kv[1]))[:top]:
        cpus.sort()
        p10 = cpus[len(cpus) // 10]
        fixed += p10 * len(cpus)
        print(f"| {name} | {len(cpus)} | {sum(cpus):.0f} | {cpus[len(cpus) // 2]:.1f} | "
              f"{p10 * len(cpus):.0f} |")  # fmt: skip
    print(f"\nfixed costs of those commands: {fixed / 60:.1f} CPU-min\n")
    print("| test | CPU s of its processes |\n|---|---|")
    for name, cpu in by_test.most_common(top):
        print(f"| {name} | {cpu:.0f} |")


if __name__ == "__main__":
    action, *args = sys.argv[1:]
    if action == "install":
        install(Path(args[0]), Path(args[1]).resolve())
    elif action == "uninstall":
        uninstall(Path(args[0]))
    else:
        report(Path(args[0]))
