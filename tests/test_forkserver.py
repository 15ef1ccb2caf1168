"""The fork server the tests start commands from (dflash/forkserver/): a command forked from it
behaves as a fresh process for its caller (directory, environment, streams, exit status,
signals, death with its caller), and it runs cold wherever the server's imports could differ."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash import forkserver
from dflash.forkserver import server as forkserver_side
from dflash.io import sha256_file

TESTS = Path(__file__).resolve().parent


def entry(argv: list[str]) -> int:
    """What the test server's children run instead of the dflash CLI."""
    print(f"served {os.getpid()} {os.getppid()}", flush=True)
    if argv[0] == "echo":
        print(os.getcwd(), os.environ.get("ECHO"), *argv[1:], flush=True)
        print(os.environ.get("TORCHINDUCTOR_CACHE_DIR"), flush=True)
        print("to stderr", file=sys.stderr)
        return int(argv[1])
    if argv[0] == "sleep":
        time.sleep(600)
    if argv[0] == "raise":
        raise RuntimeError("raised in the command")
    if argv[0] == "exit":
        os._exit(int(argv[1]))
    if argv[0] == "lock":  # held until the process is gone, as a claimed GPU's (dflash/gpus.py)
        global LOCKED
        LOCKED = open(argv[1], "w")
        fcntl.flock(LOCKED, fcntl.LOCK_EX)
    if argv[0] == "orphan-proof":  # dflash.train.comm.die_with_parent, as a torchrun worker
        from dflash.train.comm import die_with_parent

        die_with_parent()
        print(os.getpid(), flush=True)
        time.sleep(600)
    if argv[0] == "caller":  # the pid a served command gives as its own (dflash/locks.py's)
        print(forkserver.caller_pid(), flush=True)
    if argv[0] == "unflushed":
        sys.stdout.write("written\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server whose children run `entry`, and the environment its clients use."""
    folder = tmp_path_factory.mktemp("forkserver")
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop(forkserver.ENV, None)
    address = f"/tmp/dflash-fork-test-{os.getpid()}.sock"  # short: AF_UNIX caps paths at 108
    process = forkserver.start(address, str(folder / "server.log"), env=env,
                               entry="test_forkserver:entry")  # fmt: skip
    yield process, {**env, forkserver.ENV: address}, folder / "server.log"
    process.terminate()
    process.wait(timeout=30)


def client(env, *args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash", *args], env=env, text=True, **kwargs)


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_command_gets_the_clients_directory_environment_streams_and_exit_status(
    server, tmp_path
):
    process, env, _ = server
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    # the train rule sets inductor's cache folder per run, which the server's imports set too
    own = {"ECHO": "from the client", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        run = client(env | own, "echo", "3", "more", cwd=tmp_path, stdout=stdout, stderr=stderr)
        assert run.wait(timeout=60) == 3
    served, echoed, cache = out.read_text().splitlines()
    assert served.split()[0] == "served" and int(served.split()[2]) == process.pid
    assert echoed == f"{tmp_path} from the client 3 more"
    assert cache == str(tmp_path / "inductor")
    assert err.read_text() == "to stderr\n"


def test_a_command_that_raises_prints_its_traceback_and_exits_1(server):
    _, env, _ = server
    done = subprocess.run([sys.executable, "-m", "dflash", "raise"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert "RuntimeError: raised in the command" in done.stderr


def test_killing_the_client_kills_the_command_at_once(server):
    _, env, _ = server
    run = client(env, "sleep", stdout=subprocess.PIPE)
    child = int(run.stdout.readline().split()[1])
    run.kill()  # SIGKILL: the client cannot pass it on
    run.wait(timeout=30)
    assert gone(child), "the forked command outlived its killed client"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_client_ends_the_command_and_the_client_dies_of_it(server, signum):
    _, env, _ = server
    run = client(env, "sleep", stdout=subprocess.PIPE)
    child = int(run.stdout.readline().split()[1])
    run.send_signal(signum)
    assert run.wait(timeout=30) == -signum  # as a fresh process killed by it reports
    assert gone(child)


def test_an_environment_read_at_import_time_runs_the_command_cold(server):
    _, env, log = server
    done = subprocess.run([sys.executable, "-m", "dflash", "--help"], capture_output=True,
                          text=True, timeout=120, env={**env, "HF_HOME": "/elsewhere"})  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.startswith("usage: dflash-train")  # the CLI, not the test entry
    assert "declined --help: HF_HOME differs from the server's" in log.read_text()


def test_no_server_at_the_address_runs_the_command_cold(tmp_path):
    env = {**os.environ, forkserver.ENV: str(tmp_path / "none.sock")}
    done = subprocess.run([sys.executable, "-m", "dflash", "--help"], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0 and "usage: dflash-train" in done.stdout


def test_a_source_changed_since_the_import_is_never_served(tmp_path):
    snapshot = forkserver_side.Snapshot(dict(os.environ))
    request = {"executable": sys.executable, "package": forkserver._package_dir(),
               "env": dict(os.environ), "interpreter": forkserver._interpreter()}  # fmt: skip
    assert snapshot.differs(request) is None
    source = tmp_path / "module.py"
    source.write_text("x = 1\n")
    snapshot.sources[str(source)] = (forkserver_side._stat(source), sha256_file(source))
    mtime = source.stat().st_mtime_ns
    source.write_text("x = 2\n")
    os.utime(source, ns=(mtime, mtime))  # the edit's mtime put back: the ctime still moved
    assert snapshot.differs(request) == f"{source} changed since the server imported it"
    source.write_text("x = 1\n")  # the edit undone: served again
    assert snapshot.differs(request) is None
    assert "another Python" in snapshot.differs({**request, "executable": "/usr/bin/python3"})
    threads = {**request, "env": {**request["env"], "OMP_NUM_THREADS": "7"}}
    assert snapshot.differs(threads) == "OMP_NUM_THREADS differs from the server's"


def test_a_client_gone_before_its_command_started_leaves_the_server_serving(server):
    process, env, _ = server
    request = {"argv": ["dflash", "echo", "0"], "cwd": "/", "env": env, "path": sys.path,
               "executable": sys.executable, "package": forkserver._package_dir(), "umask": 0o22,
               "ignored": [], "interpreter": forkserver._interpreter(), "unbuffered": False}  # fmt: skip
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(env[forkserver.ENV])
            socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    time.sleep(1)
    done = subprocess.run([sys.executable, "-m", "dflash", "echo", "0"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("served "), done.stderr


def test_the_exit_status_is_the_commands_wait_status(server):
    _, env, _ = server
    done = subprocess.run([sys.executable, "-m", "dflash", "exit", "3"], env=env, timeout=60)
    assert done.returncode == 3  # os._exit, as dflash train exits when a peer is gone
    run = client(env, "sleep", stdout=subprocess.PIPE)
    os.kill(int(run.stdout.readline().split()[1]), signal.SIGKILL)  # the command, not its client
    assert run.wait(timeout=30) == -signal.SIGKILL


def test_the_client_returns_once_the_command_is_gone(server, tmp_path):
    _, env, _ = server
    for _ in range(3):
        subprocess.run([sys.executable, "-m", "dflash", "lock", str(tmp_path / "lock")],
                       env=env, check=True, timeout=60)  # fmt: skip
        with open(tmp_path / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: still held


def test_a_command_that_dies_with_its_parent_dies_with_its_clients_parent(server):
    """torchrun's worker asks to die with torchrun (PR_SET_PDEATHSIG): served, its parent is the
    server, so the client takes the signal on; a SIGKILLed torchrun leaves no rank training."""
    _, env, _ = server
    start = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True).wait()"
    agent = subprocess.Popen(
        [sys.executable, "-c", start, sys.executable, "-m", "dflash", "orphan-proof"],
        env={**env, "TORCHELASTIC_RUN_ID": "test"}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    agent.stdout.readline()  # "served ..."
    worker = int(agent.stdout.readline())
    agent.kill()
    agent.wait()
    assert gone(worker), "the worker outlived its SIGKILLed agent"


def test_a_signal_the_caller_ignores_stays_ignored_and_python_u_stays_unbuffered(server):
    _, env, _ = server
    ignoring = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 (nohup, `&`)
    run = client(env, "sleep", stdout=subprocess.PIPE, preexec_fn=ignoring)
    child = int(run.stdout.readline().split()[1])
    run.send_signal(signal.SIGINT)
    time.sleep(1)
    assert run.poll() is None
    os.kill(child, signal.SIGTERM)
    assert run.wait(timeout=30) == -signal.SIGTERM
    done = subprocess.run([sys.executable, "-u", "-m", "dflash", "unflushed"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.stdout.endswith("written\n")  # as torchrun's `python -u` worker writes it


def test_snakemake_forked_from_the_server_answers_and_exits_as_a_fresh_one(server, tmp_path):
    """The tests' Snakemake starts from the server too (dflash/forkserver/snakemake_cli.py)."""
    _, env, log = server
    address = env[forkserver.ENV]
    missing = ["--snakefile", str(tmp_path / "Snakefile"), "-n"]
    for args in (["--version"], missing):
        served, cold = (
            subprocess.run(
                [sys.executable, "-m", *start, *args],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )  # fmt: skip
            for start in (["dflash.forkserver.snakemake_cli", address], ["snakemake"])
        )
        assert served.returncode == cold.returncode, (served.stderr, cold.stderr)
        assert served.stdout == cold.stdout
    assert cold.returncode == 1 and "not found" in served.stdout
    assert "forked --version" in log.read_text() and "forked --snakefile" in log.read_text()


def test_a_served_command_names_its_client_as_the_process_its_caller_started(server):
    """A run's lock record names this pid, whose command line must be the caller's command."""
    _, env, _ = server
    run = client(env, "caller", stdout=subprocess.PIPE)
    out, _ = run.communicate(timeout=60)
    served, caller = out.splitlines()
    assert int(served.split()[1]) != run.pid and int(caller) == run.pid
