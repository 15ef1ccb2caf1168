"""`python -m dflash.forkserver SOCKET [MODULE:FUNCTION]`: serve (dflash/forkserver/server.py)."""

import os
import signal
import sys

from dflash.forkserver import PARENT_ENV, _prctl_pdeathsig
from dflash.forkserver.server import serve

if len(sys.argv) not in (2, 3):
    sys.exit("usage: python -m dflash.forkserver SOCKET [MODULE:FUNCTION]")
if parent := os.environ.pop(PARENT_ENV, None):
    _prctl_pdeathsig(signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before prctl took effect
        sys.exit(0)
serve(*sys.argv[1:])
