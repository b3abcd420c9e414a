"""How dpt's processes end: without the interpreter's finalization once their work is done.

Finalization with torch imported (freeing every module's objects) takes about half a second
after a run is done, and changes nothing for a process about to end; under torch 2.14 it can
even abort a finished torchrun rank. So:
- the command's process (`cli.entry`) runs what Python runs first (threading's shutdown, the exit
  handlers), then leaves;
- a torchrun rank leaves at once, its log flushed;
- the fork server leaves at once too: it ends when its launcher has gone (Python's forkserver sees
  its pipe close and raises SystemExit, or, killed with it, gets SIGKILL: parent_death.py), and
  the launcher's caller (a shell, a test, a sweep) waits for it, as it holds the launcher's
  stdout. It imports this module first of fork_server.PRELOAD; importing it anywhere else
  registers nothing. The ranks forked from it end with `os._exit` anyway.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_code(stop: SystemExit) -> int:
    """The status Python gives `sys.exit(code)`: a message is printed, and means 1."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def leave_after_exit_handlers(code: int) -> NoReturn:
    """End this process as Python would, up to its exit handlers: first what the interpreter
    itself calls, threading's shutdown (it runs the hooks that stop executors' threads, as
    concurrent.futures' and joblib's, and joins the non-daemon threads), then the exit handlers
    (logging's, multiprocessing's, a user's); then leave."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    leave_at_once(code)


def leave_at_once(code: int) -> NoReturn:
    """Leave now, the log files flushed and closed: a torchrun rank whose work is done (torch
    2.14's Gloo threads can abort it in finalization, "terminate called without an active
    exception", SIGABRT, after a successful run), the fork server, and the end of
    `leave_after_exit_handlers`."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_fork_server() -> bool:
    """Whether this process is Python's fork server: `python -c 'from multiprocessing.forkserver
    import main; main(...)'`."""
    return any("multiprocessing.forkserver import main" in arg for arg in sys.orig_argv)


if is_fork_server():
    from dpt.launch.parent_death import setup_fork_server

    setup_fork_server()  # first of all: a server whose launcher is gone must not start ranks
    atexit.register(leave_at_once, 0)
