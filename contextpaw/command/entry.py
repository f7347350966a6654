"""The `contextpaw` console script. It imports the command inside its guard, so that a Ctrl-C while
the command is still loading (mitmproxy's imports take seconds on a slow machine) ends as one line
too, as it does once the command runs.

This module imports nothing of ContextPaw's or of mitmproxy's before the guard."""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED_STATUS = 130
"""The exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report one."""


def interrupted(name: str = "contextpaw") -> int:
    """Say in one line that Ctrl-C ended the command, instead of Python's traceback; its exit status."""
    print(f"{name}: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED_STATUS


def main(argv: Sequence[str] | None = None) -> None:
    try:
        from contextpaw.command import cli

        cli.main(argv)
    except KeyboardInterrupt:
        sys.exit(interrupted())


if __name__ == "__main__":
    main()
