"""The client side of the fork server: `python -m dflash` with DFLASH_FORK_SERVER set (stdlib
only: it runs before any import)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from dflash.forkserver import (
    FORWARDED,
    _interpreter,
    _package_dir,
    _signal,
    die_with_parent,
)


def forward(address: str, entry: str | None = None) -> None:
    """Run this command in a child of the server at `address` (`entry` the function it calls,
    None: the server's own, dflash's CLI); exit as it exits. Returns only where no child was
    forked (no server there, or it declined): the caller then runs the command itself."""
    mask = os.umask(0o022)
    os.umask(mask)
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]  # e.g. nohup, `&`
    request = {
        "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path,
        "executable": sys.executable, "package": _package_dir(), "umask": mask,
        "ignored": [int(s) for s in ignored], "interpreter": _interpreter(),
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # python -u (torchrun)
        "entry": entry, "pid": os.getpid(),
    }  # fmt: skip
    parent, child, pending = os.getppid(), None, []

    def relay(signum, frame):
        pending.append(signum)
        if child is not None:
            _signal(child, signum)

    relayed = [s for s in FORWARDED if s not in ignored]
    for signum in relayed:  # before connecting: a signal from now on reaches the command
        signal.signal(signum, relay)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    status = exited = None
    try:
        sock.connect(address)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        while True:
            message = sock.recv(256).decode()
            kind, _, value = message.partition(" ")
            if kind == "OK":
                child = int(value)
                for signum in pending:  # those that came before the child did
                    _signal(child, signum)
            elif kind == "PDEATHSIG":  # the command asked to die with its parent: so does this
                if not die_with_parent(int(value), parent):
                    os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "EXIT":
                exited = int(value)
            elif kind == "STATUS":
                status = int(value)
                break
            else:  # closed: declined, or the server went away
                break
    except OSError:
        pass
    sock.close()
    for signum in relayed:
        signal.signal(signum, signal.SIG_DFL if child is not None else signal.default_int_handler
                      if signum == signal.SIGINT else signal.SIG_DFL)  # fmt: skip
    if child is None:  # nothing ran: run cold, dying first of any signal that came meanwhile
        for signum in pending:
            os.kill(os.getpid(), signum)
        return
    if status is None:  # the server is gone: the child's own word, else a signal passed on
        status = exited if exited is not None else (-pending[-1] if pending else None)
    if status is None:
        print(f"dflash: the forked command (pid {child}) ended without an exit status "
              "(killed?)", file=sys.stderr)  # fmt: skip
        os._exit(1)
    if status < 0:  # die as the child died, for the caller's wait status
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        os._exit(128 - status)
    os._exit(status)
