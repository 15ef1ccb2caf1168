"""A fork server for `python -m dflash`: one process imports torch, transformers and every stage
once, and each command forks from it instead of importing them again (4-14 s of a process on a
2-core machine, where the test suite starts several hundred). Opt-in, for the tests:
`python -m dflash.forkserver SOCKET` serves, and `DFLASH_FORK_SERVER=SOCKET` in a command's
environment makes `python -m dflash ...` a thin client. The client hands its arguments, working
directory, environment, `sys.path` and standard streams to a forked child. It forwards the signals
it gets and exits as the child exits, by the same signal where the child died of one. A child
whose client dies (SIGKILL included) kills itself at once, so killing the command kills its work,
as with a fresh process.

The server declines, and the client then runs the command itself, wherever the child could differ
from a fresh process: another Python or dflash tree, an environment variable that a library reads
at import time (`IMPORT_TIME_ENV`) set otherwise than in the server, or a dflash source changed
since the server imported it. Stdlib only on the client's side: it runs before any import.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

ENV = "DFLASH_FORK_SERVER"
# Read when a library is imported (so they must match the server's), not when it is used:
# Python's own, torch's and inductor's, Hugging Face's, the CUDA and linker settings.
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                   "TOKENIZERS", "CUDA", "NCCL", "LD_", "MPLBACKEND", "WANDB", "MLFLOW")  # fmt: skip
# ... but these are read when used (thread pools, process groups), which is in the child
USE_TIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip
MAX_REQUEST = 1 << 20


def _package_dir() -> str:
    return str(Path(__file__).resolve().parent)


# -- the client: `python -m dflash` with DFLASH_FORK_SERVER set ------------------------------------


def forward(address: str) -> None:
    """Run this command in a child of the server at `address`; exit as it exits. Returns only
    where no child was forked (no server there, or it declined): the caller then runs the command
    itself."""
    request = {
        "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path,
        "executable": sys.executable, "package": _package_dir(),
    }  # fmt: skip
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        answer = sock.recv(256).decode()
    except OSError:
        sock.close()
        return
    if not answer.startswith("OK "):
        sock.close()
        return
    child, forwarded = int(answer.split()[1]), []

    def relay(signum, frame):
        forwarded.append(signum)
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, relay)
    end = sock.recv(256).decode()  # the child's exit, or nothing where it died without one
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    kind, _, value = end.partition(" ")
    if kind == "EXIT":
        os._exit(int(value))
    signum = int(value) if kind == "SIGNAL" else (forwarded[-1] if forwarded else None)
    if signum is None:
        print(f"dflash: the forked command (pid {child}) ended without an exit status "
              "(killed?)", file=sys.stderr)  # fmt: skip
        os._exit(1)
    os.kill(os.getpid(), signum)  # die as the child died, for the caller's wait status
    os._exit(128 + signum)


# -- the server --------------------------------------------------------------------------------


def preload() -> None:
    """Import what the stages import: torch, transformers' model classes, and each stage's
    module (their own imports follow)."""
    import importlib

    import torch  # noqa: F401
    import transformers

    from dflash.cli import build_parser  # noqa: F401
    from dflash.stages import STAGES

    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        getattr(transformers, name)
    importlib.import_module("transformers.models.llama.modeling_llama")
    for stage in STAGES.values():
        importlib.import_module(stage.run.split(":")[0])


class Snapshot:
    """What the server's imports depend on, to decline a request that would differ."""

    def __init__(self, env_before: dict):
        self.env = {k: v for k, v in env_before.items() if self.import_time(k)}
        # what the imports themselves set (inductor exports its cache folder): a fresh process
        # of the same environment would have set it too
        self.exported = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        self.sources = {}
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None) or ""
            if module.__name__.split(".")[0] == "dflash" and path.endswith(".py"):
                self.sources[path] = os.stat(path).st_mtime_ns

    @staticmethod
    def import_time(key: str) -> bool:
        return key.startswith(IMPORT_TIME_ENV) and not key.startswith(USE_TIME_ENV)

    def differs(self, request: dict) -> str | None:
        """Why `request` cannot be served from this process's imports, or None."""
        if request["executable"] != sys.executable:
            return f"another Python ({request['executable']})"
        if request["package"] != _package_dir():
            return f"another dflash tree ({request['package']})"
        env = {k: v for k, v in request["env"].items() if self.import_time(k)}
        for key in sorted(env.keys() | self.env.keys()):
            if env.get(key) != self.env.get(key):
                return f"{key} differs from the server's"
        for path, mtime in self.sources.items():
            try:
                if os.stat(path).st_mtime_ns != mtime:
                    return f"{path} changed since the server imported it"
            except OSError:
                return f"{path} is gone"
        return None


def serve(address: str, entry: str = "dflash.cli:main") -> None:
    """Preload, then fork a child per request until SIGTERM. `entry` is the function a child runs
    with the client's arguments (the tests name a function of theirs)."""
    env_before = dict(os.environ)
    preload()
    module_name, func_name = entry.split(":")
    main = getattr(__import__(module_name, fromlist=[func_name]), func_name)
    snapshot = Snapshot(env_before)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{address}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, address)  # clients see the socket only once it accepts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log(f"serving {address} (pid {os.getpid()}, {len(snapshot.sources)} dflash sources)")
    try:
        while True:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
                request = json.loads(message)
            except (OSError, ValueError) as e:
                log(f"bad request: {e}")
                conn.close()
                continue
            reason = snapshot.differs(request)
            if reason is not None:
                log(f"declined {' '.join(request['argv'][1:3])}: {reason}")
                _close(fds, conn)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                request["env"] |= snapshot.exported
                _child(conn, fds, request, main)  # never returns
            log(f"forked {' '.join(request['argv'][1:2])} as pid {pid}")
            _close(fds, conn)
    finally:
        with_suppressed_unlink(address)


def _close(fds, conn) -> None:
    for fd in fds:
        os.close(fd)
    conn.close()


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def log(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} dflash.forkserver: {line}", file=sys.stderr, flush=True)


def _child(conn: socket.socket, fds: list[int], request: dict, main) -> None:
    """Become the client's command: its streams, directory, environment and path; a thread that
    kills this process when the client's end closes; then `main(argv)`, atexit and the exit status
    back to the client."""
    import atexit
    import threading
    import traceback

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited on
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as a fresh interpreter sets it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv, sys.path[:] = request["argv"], request["path"]
    if "numpy" in sys.modules:  # a fresh process's global stream is seeded afresh
        sys.modules["numpy"].random.seed()

    def orphaned():
        conn.recv(1)  # the client never writes: this returns when its end closes
        os.kill(os.getpid(), signal.SIGKILL)

    conn.sendall(f"OK {os.getpid()}".encode())
    threading.Thread(target=orphaned, daemon=True).start()
    end = "EXIT 0"
    try:
        code = main(request["argv"][1:])
        end = f"EXIT {code or 0}"
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        end = f"EXIT {code or 0}"
    except KeyboardInterrupt:
        end = f"SIGNAL {int(signal.SIGINT)}"
    except BaseException:
        traceback.print_exc()
        end = "EXIT 1"
    # what the interpreter does at exit: non-daemon threads joined, atexit run, streams flushed
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    conn.sendall(end.encode())
    os._exit(0)


def start(address: str, log_path: str, env: dict | None = None, entry: str | None = None,
          timeout_s: float = 120.0):  # fmt: skip
    """Start a server at `address` in the background (`env` its environment, `entry` what its
    children run, its log appended to `log_path`), ended when the caller's process ends, and wait
    until it accepts; returns its process. For the tests."""
    import ctypes
    import subprocess

    def die_with_parent():  # prctl(PR_SET_PDEATHSIG, SIGTERM): no server outlives its caller
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))

    with_suppressed_unlink(address)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "dflash.forkserver", address, *([entry] if entry else [])],
            env=env,
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(address):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"dflash.forkserver did not start: see {log_path}")
        time.sleep(0.1)
    return process


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m dflash.forkserver SOCKET [MODULE:FUNCTION]")
    serve(*sys.argv[1:])
