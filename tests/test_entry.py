"""The command's process ends as Python would end it (status, threads, exit handlers), without
the interpreter's finalization; the fork server likewise, and no other process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd

# A user's process around `entry`: a non-daemon thread still at work, an executor's idle thread
# (it waits for threading's shutdown hook; joblib's sweeps have them) and an exit handler.
PROBE = """
import atexit, sys, threading, time
atexit.register(lambda: print("exit handler ran", file=sys.stderr, flush=True))
def work():  # still running when the command's one line comes, however slow the machine:
    while threading.main_thread().is_alive():  # until the main thread is done (its shutdown)
        time.sleep(0.01)
    print("thread finished", file=sys.stderr, flush=True)
threading.Thread(target=work).start()
from concurrent.futures import ThreadPoolExecutor  # its thread stops at threading's shutdown
ThreadPoolExecutor(1).submit(time.sleep, 0.1)
sys.argv = ["dpt", *sys.argv[1:]]
from dpt.launch.cli import entry
entry()
print("not reached", file=sys.stderr)
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["trainer.lr=0.1"], 1)])
def test_the_command_keeps_its_status_threads_and_exit_handlers(args: list[str], code: int) -> None:
    result = run_cmd([sys.executable, "-c", PROBE, *args], check=False, timeout=50)
    assert result.returncode == code, result.output
    assert result.stderr.splitlines()[-2:] == ["thread finished", "exit handler ran"]
    assert "not reached" not in result.stderr


def test_importing_the_servers_exit_elsewhere_changes_nothing() -> None:
    code = (
        "import atexit, sys; atexit.register(print, 'exit handler ran'); "
        "import dpt.launch.process_exit; sys.exit(3)"
    )
    result = run_cmd([sys.executable, "-c", code], check=False, timeout=30)
    assert (result.returncode, result.stdout) == (3, "exit handler ran\n")


# Python's own fork server, in a process of its own (this one's start method left alone).
SERVER = """
import multiprocessing
from dpt.launch.process_exit import is_fork_server
if __name__ == "__main__":
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        print(is_fork_server(), pool.apply(is_fork_server))
"""


@pytest.mark.timeout(60)
def test_a_fork_server_knows_itself(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    result = run_cmd([sys.executable, str(script)], timeout=50)
    assert result.stdout == "False True\n"  # the pool's worker is forked from the server
