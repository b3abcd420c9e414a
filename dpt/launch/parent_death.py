"""Every process dpt starts ends when the process that started it ends.

Killed with SIGKILL (the OOM killer, a scheduler's hard kill, `kill -9`), a launcher cannot tell
its children anything: without this its ranks, re-parented to init, trained on and wrote
checkpoints into a folder that a second run could then take. So each process asks the kernel for
a signal when its parent ends (Linux's parent-death signal, `prctl(PR_SET_PDEATHSIG)`), or, where
there is none, watches its parent's pid from a thread:
- the fork server (dpt/launch/fork_server.py): SIGKILL when its launcher ends; it holds no work;
- a rank, forked from the fork server or started by torchrun: SIGTERM, as when a launcher passes
  a SIGTERM on: it finishes its step, writes a checkpoint and leaves (or, still starting, ends);
- anything a rank forks from its main thread (DataLoader workers): SIGKILL with the rank.

The kernel sends the signal when the parent *thread* ends, so only forks from a main thread are
covered; a process forked by a short-lived thread would be killed with that thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCH_INTERVAL_S = 0.5

# The environment variable that tells the fork server its launcher's pid (set by fork_server).
LAUNCHER_PID = "DPT_FORK_SERVER_PARENT"

# What this process's children get when it ends (changed in each generation; see `_after_fork`).
_children_signal = signal.SIGTERM
_forking_parent: int | None = None  # this process's pid while its main thread forks


def end_with_parent(sig: int, parent: int | None = None) -> None:
    """`sig` to this process when its parent ends. `parent`: the pid that started this process,
    if known; when it has already ended (this process was re-parented before it asked), `sig`
    comes at once."""
    expected = os.getppid() if parent is None else parent
    if not _ask_kernel(sig):
        _watch(expected, sig)
    if os.getppid() != expected:
        os.kill(os.getpid(), sig)


def children_end_with_this_process(sig: int = signal.SIGTERM) -> None:
    """Every process this one forks from its main thread gets `sig` when this one ends (and
    their own children SIGKILL when they end)."""
    global _children_signal
    _children_signal = signal.Signals(sig)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork)


def _before_fork() -> None:
    global _forking_parent
    is_main = threading.current_thread() is threading.main_thread()
    _forking_parent = os.getpid() if is_main else None


def _after_fork() -> None:
    global _children_signal
    if _forking_parent is None:
        return
    end_with_parent(_children_signal, _forking_parent)
    _children_signal = signal.SIGKILL  # a rank's own children (loader workers) hold no work


def _ask_kernel(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _watch(parent: int, sig: int) -> None:
    """Where the kernel offers no parent-death signal (macOS): a thread that polls the parent."""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(WATCH_INTERVAL_S)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="dpt-parent-watch", daemon=True).start()


def setup_fork_server() -> None:
    """In the fork server (imported through fork_server.PRELOAD): end with the launcher, and make
    each rank forked from here end with this server."""
    launcher = os.environ.get(LAUNCHER_PID)
    end_with_parent(signal.SIGKILL, int(launcher) if launcher else None)
    children_end_with_this_process(signal.SIGTERM)
