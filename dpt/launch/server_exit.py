"""Imported by the fork server alone (fork_server.PRELOAD): the server leaves at once.

The server ends when its launcher has gone (Python's forkserver sees its pipe close and raises
SystemExit). Its interpreter's finalization, with torch imported, takes about half a second of
CPU, and the launcher's caller (a shell, a test, a sweep) waits for it: it holds the launcher's
stdout. The server has nothing to flush but that, so it skips the rest with `os._exit`. Its ranks
are not affected: a forked child of the server ends with `os._exit` anyway.
"""

from __future__ import annotations

import atexit
import os
import sys


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def is_fork_server() -> bool:
    """Whether this process is Python's fork server: `python -c 'from multiprocessing.forkserver
    import main; main(...)'`. Anywhere else, importing this module changes nothing."""
    return any("multiprocessing.forkserver import main" in arg for arg in sys.orig_argv)


if is_fork_server():
    atexit.register(_leave)
