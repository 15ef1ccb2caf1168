import os

if os.environ.get("DFLASH_FORK_SERVER"):  # the tests' fork server (dflash/forkserver/)
    from dflash.forkserver.client import forward

    forward(os.environ["DFLASH_FORK_SERVER"])  # returns only where it did not run the command

from dflash.cli import main  # noqa: E402

raise SystemExit(main())
