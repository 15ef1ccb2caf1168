"""A fork server for `python -m dflash`: one process imports torch, transformers and every stage
once, and each command forks from it instead of importing them again (4-14 s of a process on a
2-core machine, where the test suite starts several hundred). Opt-in, for the tests:
`python -m dflash.forkserver SOCKET` serves (`server.py`), and `DFLASH_FORK_SERVER=SOCKET` in a
command's environment makes `python -m dflash ...` a thin client (`client.py`). The client hands
its arguments, working directory, environment, `sys.path` and standard streams to a forked child.
It forwards the signals it gets and exits as the child exits, by the same signal where the child
died of one. A child whose client dies (SIGKILL included) kills itself at once, so killing the
command kills its work, as with a fresh process.

`python -m dflash.forkserver.snakemake_cli SOCKET ARGS` does the same for `snakemake ARGS`.
Children share the server's string-hash seed, so sets of strings iterate alike in all of them
(the tests' second full run starts Snakemake and its stages cold, so an order that leaks into a
file shows).

The server declines, and the client then runs the command itself, wherever the child could differ
from a fresh process: another Python or dflash tree, an environment variable that a library reads
at import time (`IMPORT_TIME_ENV`) set otherwise than in the server, or a dflash source changed
since the server imported it. Stdlib only on the client's side: it runs before any import.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

ENV = "DFLASH_FORK_SERVER"
PARENT_ENV = "DFLASH_FORK_SERVER_PARENT"  # the process whose death ends the server
# Read when a library the server imports is imported (so they must match the server's), not when
# it is used: Python's own, torch's and inductor's, Hugging Face's, polars', CUDA's, the linker's.
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                   "TOKENIZERS", "POLARS", "CUDA", "NCCL", "LD_",
                   # thread pools sized when torch's OpenMP/MKL and numpy's OpenBLAS load (a child
                   # given OMP_NUM_THREADS=1 keeps the server's count; Snakemake sets all of these
                   # for every job), and the allocators' settings, read at process start
                   "OMP_", "MKL_", "KMP_", "GOMP_", "GOTO_", "OPENBLAS_", "VECLIB_", "NUMEXPR_",
                   "_RJEM_", "MALLOC_", "GLIBC_TUNABLES",
                   # the interpreter's start (locale, time zone), and paths derived at import
                   # (huggingface_hub's cache from HOME/XDG_CACHE_HOME, inductor's from USER)
                   "LANG", "LC_", "TZ", "HOME", "XDG_CACHE_HOME", "USER", "LOGNAME",
                   "COV_CORE_", "COVERAGE_PROCESS_START")  # fmt: skip
# ... but these are read when used (process groups, compile caches), in the child.
# Inductor's cache folder is read at import only by dynamo's DynamoCache, which serves
# TORCH_CACHING_PRECOMPILE=1 alone (compared above); the train rule sets the folder per run.
USE_TIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip
MAX_REQUEST = 1 << 20
SNAKEMAKE = "snakemake.cli:main"  # the other command a server runs (snakemake_cli.py)


def _package_dir() -> str:
    return str(Path(__file__).resolve().parents[1])  # dflash/, this package's parent


def _interpreter() -> list:
    """What else than the environment sets the interpreter up: its flags and -W/-X options."""
    return [list(sys.flags), sys.warnoptions, sorted(map(str, sys._xoptions.items()))]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def die_with_parent(signum: int, parent: int | None = None) -> bool:
    """prctl(PR_SET_PDEATHSIG): this process gets `signum` when its parent dies. False where
    `parent` (its parent's pid, read before the call) is gone already: it died before prctl took
    effect, and no signal will come. Linux only."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    return parent is None or os.getppid() == parent


_CLIENT: socket.socket | None = (
    None  # a served child's connection to its client (server.py sets it)
)


_CLIENT_PID: int | None = None  # that client's pid


def caller_pid() -> int:
    """The process the caller started and waits on: this one, or a served command's client (the
    forked child's own pid and command line are the server's business)."""
    return os.getpid() if _CLIENT_PID is None else _CLIENT_PID


def served() -> bool:
    """Whether this process is a command forked from a server (its parent is the server)."""
    return _CLIENT is not None


def client_dies_with_parent(signum: int) -> None:
    """prctl(PR_SET_PDEATHSIG) for a served command: applied to its client, the process its
    caller started and waits on, whose death kills the command."""
    _CLIENT.sendall(f"PDEATHSIG {int(signum)}".encode())


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def start(address: str, log_path: str, env: dict | None = None, entry: str | None = None,
          timeout_s: float = 120.0):  # fmt: skip
    """Start a server at `address` in the background (`env` its environment, `entry` what its
    children run, its log appended to `log_path`), ended when the caller's process ends, and wait
    until it accepts; returns its process. For the tests."""
    import subprocess

    with_suppressed_unlink(address)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "dflash.forkserver", address, *([entry] if entry else [])],
            # no server outlives its caller: the server asks for that itself (a preexec_fn may
            # deadlock in a parent with threads, as a pytest-xdist worker has: execnet's, polars')
            env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            cwd="/",  # not the caller's: `-m` puts the cwd first on sys.path (a dflash/ there)
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(address):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"dflash.forkserver did not start: see {log_path}")
        time.sleep(0.1)
    return process
