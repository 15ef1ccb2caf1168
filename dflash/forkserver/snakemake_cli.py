"""`python -m dflash.forkserver.snakemake_cli SOCKET ARGS...`: `snakemake ARGS`, forked from the
fork server at SOCKET, which has imported Snakemake, its plugins and the workflow's dflash modules
(3-4 s of every Snakemake start on a 2-core machine, where the tests start it about a hundred
times). Where the server declines or SOCKET is empty, it runs here, as `python -m snakemake ARGS`.
"""

import importlib.util
import os
import sys

from dflash.forkserver import SNAKEMAKE
from dflash.forkserver.client import forward

address, args = sys.argv[1], sys.argv[2:]
# as `python -m snakemake` names itself (found without importing it)
sys.argv = [
    os.path.join(os.path.dirname(importlib.util.find_spec("snakemake").origin), "__main__.py"),
    *args,
]
if address:
    sys.path.append(".snakemake/pip-deployments")  # for the child: importing snakemake adds it
    forward(address, entry=SNAKEMAKE)  # returns only where it did not run the command
    sys.path.pop()  # declined: the import below adds it

from snakemake.cli import main  # noqa: E402

main(args)
