"""Processes that dpt starts end with the process that started them (dpt/launch/parent_death.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, is_running

MIDDLE = """
import os, signal, sys, time
from dpt.launch import parent_death
parent_death.children_end_with_this_process(signal.SIGTERM)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(30)
def test_a_forked_child_ends_when_its_parent_is_killed() -> None:
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert middle.stdout is not None
    child = int(middle.stdout.readline())
    assert is_running(child)
    middle.kill()  # SIGKILL: the parent can tell its child nothing
    middle.wait()
    deadline = time.monotonic() + 5
    while is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(child)


@pytest.mark.timeout(30)
def test_a_process_whose_parent_already_ended_gets_the_signal_at_once() -> None:
    """Re-parented before it could ask for the signal: `end_with_parent` sees another parent."""
    code = ("import signal, time; from dpt.launch import parent_death; "
            "parent_death.end_with_parent(signal.SIGTERM, parent=1); time.sleep(20)")  # fmt: skip
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=20)
    assert ended.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_the_watch_thread_signals_where_the_kernel_offers_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """macOS has no parent-death signal: a thread polls the parent's pid (here, one that is
    not this process's parent, so the signal comes at the first look)."""
    from dpt.launch import parent_death

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(parent_death, "_ask_kernel", lambda sig: False)
    monkeypatch.setattr(parent_death.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(parent_death, "WATCH_INTERVAL_S", 0.01)
    parent_death.end_with_parent(signal.SIGUSR1, parent=os.getppid() + 10**6)
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [(os.getpid(), signal.SIGUSR1)] * 2  # the check at once, and the watcher
