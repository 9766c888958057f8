"""The `dlo` console script. It imports the command line (torch, diffusers: seconds) inside
the Ctrl-C handling, so an interrupt during those imports ends with one line too."""

from __future__ import annotations

import sys

from dlo.cli.exit_status import INTERRUPTED_STATUS


def main() -> int:
    try:
        from dlo.cli.main import main as run
    except KeyboardInterrupt:
        print("dlo: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return run()
