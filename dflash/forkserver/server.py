"""The server side of the fork server: preload, decline what a fresh process would do otherwise,
fork a child per request and report its wait status once it is reaped."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from dflash import forkserver
from dflash.forkserver import (
    FORWARDED,
    IMPORT_TIME_ENV,
    MAX_REQUEST,
    USE_TIME_ENV,
    _interpreter,
    _package_dir,
    with_suppressed_unlink,
)
from dflash.io import sha256_file


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


def preload_snakemake() -> bool:
    """Import Snakemake, its scheduler, store and plugins (argument parsing discovers them all:
    the SLURM plugin alone imports pandas), and what the workflow's rules import from dflash.
    False where Snakemake is not installed: its requests are then declined."""
    import importlib

    try:
        from snakemake.cli import get_argument_parser
    except ImportError:
        return False
    get_argument_parser()
    for name in ("snakemake.api", "snakemake.dag", "snakemake.persistence",
                 "snakemake.scheduling.job_scheduler", "dflash.preflight", "dflash.custody",
                 "dflash.record", "dflash.eval.report", "dflash.manifest", "dflash.model.start"):  # fmt: skip
        importlib.import_module(name)
    return True


class Snapshot:
    """What the server's imports depend on, to decline a request that would differ."""

    def __init__(self, env_before: dict):
        self.env = {k: v for k, v in env_before.items() if self.import_time(k)}
        # what the imports themselves set where it was unset (inductor exports its cache
        # folder): a fresh process of the same environment would have set it too
        self.exported = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        self.interpreter = _interpreter()
        self.tmpdir = _tmpdir(env_before)
        self.sources = {}  # path: (stat, sha256); the hash where the stat changed (edit undone)
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None) or ""
            if module.__name__.split(".")[0] == "dflash" and path.endswith(".py"):
                self.sources[path] = (_stat(path), sha256_file(path))

    @staticmethod
    def import_time(key: str) -> bool:
        return key.startswith(IMPORT_TIME_ENV) and not key.startswith(USE_TIME_ENV)

    def differs(self, request: dict) -> str | None:
        """Why `request` cannot be served from this process's imports, or None."""
        if request["executable"] != sys.executable:
            return f"another Python ({request['executable']})"
        if request["package"] != _package_dir():
            return f"another dflash tree ({request['package']})"
        if request["interpreter"] != self.interpreter:
            return "other interpreter flags or -W/-X options"
        env = {k: v for k, v in request["env"].items() if self.import_time(k)}
        for key in sorted(env.keys() | self.env.keys()):
            # a value the imports set themselves (inductor's cache folder), inherited from a
            # command forked here, is what a fresh process would set too
            if env.get(key) not in (self.env.get(key), self.exported.get(key, self.env.get(key))):
                return f"{key} differs from the server's"
        if _tmpdir(request["env"]) != self.tmpdir:  # tempfile's, inductor's cache (Snakemake
            return "another temporary folder"  # sets TMPDIR=/tmp for every job: same as unset)
        for path, (stat, digest) in self.sources.items():
            try:
                if _stat(path) != stat:
                    if sha256_file(path) != digest:
                        return f"{path} changed since the server imported it"
                    self.sources[path] = (_stat(path), digest)
            except OSError:
                return f"{path} is gone"
        return None


def _stat(path: str) -> tuple:
    st = os.stat(path)  # ctime: an edit whose mtime was put back is still seen
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _tmpdir(env: dict) -> str:
    """tempfile.gettempdir() of a process with `env` (but for unwritable candidates)."""
    return (
        next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k)), "/tmp").rstrip("/") or "/"
    )


def serve(address: str, entry: str = "dflash.cli:main") -> None:
    """Preload, then fork a child per request until SIGTERM; send each client its child's wait
    status once the child is reaped (gone, its files closed). `entry` is the function a child
    runs with the client's arguments (the tests name a function of theirs)."""
    import selectors

    env_before = dict(os.environ)
    preload()
    entries = {None: _function(entry)}  # a request names no entry: the server's own
    if preload_snakemake():
        entries[forkserver.SNAKEMAKE] = _function(forkserver.SNAKEMAKE)
    snapshot = Snapshot(env_before)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{address}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, address)  # clients see the socket only once it accepts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    log(f"serving {address} (pid {os.getpid()}, {len(snapshot.sources)} dflash sources)")
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    _accept(listener, snapshot, entries, selector)
                else:  # a child's pidfd: it ended
                    pid, conn = key.data
                    selector.unregister(key.fileobj)
                    os.close(key.fileobj)
                    _, status = os.waitpid(pid, 0)
                    try:
                        conn.sendall(f"STATUS {os.waitstatus_to_exitcode(status)}".encode())
                    except OSError:
                        pass  # its client is gone
                    conn.close()
    finally:
        with_suppressed_unlink(address)


def _function(entry: str):
    module_name, func_name = entry.split(":")
    return getattr(__import__(module_name, fromlist=[func_name]), func_name)


def _accept(listener, snapshot: Snapshot, entries: dict, selector) -> None:
    import selectors

    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(2)  # a client stopped before it sent its request blocks no other
        message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        conn.settimeout(None)
        request = json.loads(message)
        reason = snapshot.differs(request)
        if request.get("entry") not in entries:
            reason = f"no {request['entry']} here"
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"bad request: {e!r}")
        _close(fds, conn)
        return
    if reason is not None:
        log(f"declined {' '.join(request['argv'][1:3])}: {reason}")
        _close(fds, conn)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:
        log(f"fork failed: {e}")
        _close(fds, conn)
        return
    if pid == 0:
        try:
            # nothing of the server's stays open here: its socket, and its ends of the other
            # children's connections (a client whose server is gone waits for their EOF)
            for key in list(selector.get_map().values()):
                if key.fileobj is not listener:
                    os.close(key.fileobj)
                    key.data[1].close()
            selector.close()
            listener.close()
            request["env"] = snapshot.exported | request["env"]
            _child(conn, fds, request, entries[request.get("entry")])  # never returns
        finally:
            os._exit(70)  # never back into the server's loop (nor its `finally`: the socket)
    _close(fds)  # the child's now; the connection stays, for the wait status
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ, (pid, conn))
    log(f"forked {' '.join(request['argv'][1:2])} as pid {pid}")


def _close(fds: list[int], conn: socket.socket | None = None) -> None:
    for fd in fds:
        os.close(fd)
    if conn is not None:
        conn.close()


def log(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} dflash.forkserver: {line}", file=sys.stderr, flush=True)


def _child(conn: socket.socket, fds: list[int], request: dict, main) -> None:
    """Become the client's command: its streams, directory, environment, path, umask and signal
    dispositions; a thread that kills this process when the client's end closes; then
    `main(argv)`, atexit, and the exit status as the interpreter would give it."""
    import atexit
    import importlib
    import io
    import tempfile
    import threading
    import traceback

    for signum in FORWARDED:  # as the client's caller left them (a fresh process inherits them)
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, signal.SIG_IGN if signum in request["ignored"] else default)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["unbuffered"]:  # python -u: streams without buffers, as torchrun starts workers
        for name in ("stdout", "stderr"):
            old = getattr(sys, name)
            raw = io.FileIO(old.fileno(), "w", closefd=False)
            new = io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True)
            setattr(sys, name, new)
            setattr(sys, f"__{name}__", new)
    else:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as a fresh interpreter sets it
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv, sys.path[:] = request["argv"], request["path"]
    tempfile.tempdir = None
    importlib.invalidate_caches()
    # a fresh process's global streams are seeded afresh (`random` reseeds itself at fork)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()

    def orphaned():
        conn.recv(1)  # the client never writes: this returns when its end closes
        os.kill(os.getpid(), signal.SIGKILL)

    forkserver._CLIENT, forkserver._CLIENT_PID = conn, request["pid"]
    conn.sendall(f"OK {os.getpid()}".encode())
    threading.Thread(target=orphaned, daemon=True).start()
    code, interrupted = 0, False
    try:
        code = main(request["argv"][1:])
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    code = int(code or 0) & 0xFF
    # what the interpreter does at exit: non-daemon threads joined, atexit run, streams flushed
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # a second Ctrl-C
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    try:
        conn.sendall(f"EXIT {code}".encode())  # for a client whose server is gone
    except OSError:
        pass
    os._exit(code)
