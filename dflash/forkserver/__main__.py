"""`python -m dflash.forkserver SOCKET [MODULE:FUNCTION]`: serve (dflash/forkserver/server.py)."""

import os
import signal
import sys

from dflash.forkserver import PARENT_ENV, die_with_parent
from dflash.forkserver.server import serve

if len(sys.argv) not in (2, 3):
    sys.exit("usage: python -m dflash.forkserver SOCKET [MODULE:FUNCTION]")
if parent := os.environ.pop(PARENT_ENV, None):
    if not die_with_parent(signal.SIGTERM, int(parent)):
        sys.exit(0)
serve(*sys.argv[1:])
