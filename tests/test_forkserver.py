"""The fork server the tests start commands from (dflash/forkserver.py): a command forked from it
behaves as a fresh process for its caller (directory, environment, streams, exit status,
signals, death with its caller), and it runs cold wherever the server's imports could differ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash import forkserver

TESTS = Path(__file__).resolve().parent


def entry(argv: list[str]) -> int:
    """What the test server's children run instead of the dflash CLI."""
    print(f"served {os.getpid()} {os.getppid()}", flush=True)
    if argv[0] == "echo":
        print(os.getcwd(), os.environ.get("ECHO"), *argv[1:], flush=True)
        print("to stderr", file=sys.stderr)
        return int(argv[1])
    if argv[0] == "sleep":
        time.sleep(600)
    if argv[0] == "raise":
        raise RuntimeError("raised in the command")
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
    with open(out, "w") as stdout, open(err, "w") as stderr:
        run = client({**env, "ECHO": "from the client"}, "echo", "3", "more",
                     cwd=tmp_path, stdout=stdout, stderr=stderr)  # fmt: skip
        assert run.wait(timeout=60) == 3
    served, echoed = out.read_text().splitlines()
    assert served.split()[0] == "served" and int(served.split()[2]) == process.pid
    assert echoed == f"{tmp_path} from the client 3 more"
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
    snapshot = forkserver.Snapshot(dict(os.environ))
    request = {"executable": sys.executable, "package": forkserver._package_dir(),
               "env": dict(os.environ)}  # fmt: skip
    assert snapshot.differs(request) is None
    source = tmp_path / "module.py"
    source.write_text("x = 1\n")
    snapshot.sources[str(source)] = source.stat().st_mtime_ns
    os.utime(source, ns=(0, source.stat().st_mtime_ns + 1))
    assert snapshot.differs(request) == f"{source} changed since the server imported it"
    assert "another Python" in snapshot.differs({**request, "executable": "/usr/bin/python3"})
