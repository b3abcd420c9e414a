"""`python train.py` started warm (tests/warm_starts.py) is what a test of a process needs: a
process of its own, in a session of its own, with the test's pipes, folder and environment, its
exit code and the signal that ended it; a start whose environment could change what the server
imported starts cold. A warm start that launches ranks starts its fork server warm too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import FAST, TRAIN, rank_pid, run_until, session_members, start
from tests.warm_starts import WarmProcess

pytestmark = pytest.mark.slow  # a server, and the processes it forks


@pytest.mark.timeout(120)
def test_a_warm_start_runs_train_py_in_its_own_session_and_folder(tmp_path: Path) -> None:
    proc = start([sys.executable, str(TRAIN), "trainer.batch_size=abc",
                  f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)  # fmt: skip
    assert isinstance(proc, WarmProcess)
    assert os.getsid(proc.pid) == proc.pid  # a session of its own: killpg reaches all it starts
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout + stderr
    assert stderr.startswith("Error: trainer.batch_size: Value 'abc'"), stderr
    assert not (tmp_path / "run").exists()  # refused before any run folder


@pytest.mark.timeout(180)
def test_a_signal_ends_a_warm_start_as_it_ends_a_process(tmp_path: Path) -> None:
    result = run_until(tmp_path / "run", [*FAST, "trainer.max_steps=1000"], "step 5/",
                       lambda proc, _: os.killpg(proc.pid, signal.SIGKILL))  # fmt: skip
    assert result.returncode == -signal.SIGKILL
    assert "[rank 0]" in result.stdout  # the pipes carried the run's console


@pytest.mark.timeout(120)
def test_what_the_server_imported_with_another_environment_starts_cold(tmp_path: Path) -> None:
    for env in ({"PYTHONPATH": str(tmp_path)}, {"OMP_NUM_THREADS": "2"}):
        proc = start([sys.executable, str(TRAIN), "--help"], env=env)
        assert isinstance(proc, subprocess.Popen)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    # and any other command than `python train.py`
    proc = start([sys.executable, "-c", "print(1)"])
    assert isinstance(proc, subprocess.Popen)
    assert proc.communicate(timeout=60) == ("1\n", "")


@pytest.mark.timeout(120)
def test_a_worker_whose_environment_changed_starts_warm_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable a test left set in the worker (a world's MASTER_PORT) is in the environment of
    every start after it: the server is started anew with it, and the starts stay warm."""
    monkeypatch.setenv("MASTER_PORT", "29999")
    proc = start([sys.executable, str(TRAIN), "--help"], cwd=tmp_path)
    assert isinstance(proc, WarmProcess)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.startswith("dpt: data-parallel training")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(180)
def test_a_warm_ddp_launch_forks_its_ranks_from_a_fork_server_started_warm(tmp_path: Path) -> None:
    """The launcher's fork server is the template the warm start forked before `train.py`'s
    first line (its command line is still the warm server's, not `python -c ...`): a child of
    the launcher, as a spawned server is, and the ranks are its children."""
    tree: dict[int, tuple[int, str]] = {}
    launcher: list[int] = []

    def look(proc: Any, _: str) -> None:
        launcher.append(proc.pid)
        for pid in session_members(proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            tree[pid] = (_parent(pid), cmdline)

    run = tmp_path / "run"
    result = run_until(run, [*FAST, "strategy=ddp", "trainer.max_steps=40",
                             "trainer.log_every_n_steps=1"], "step 2/", look)  # fmt: skip
    assert result.returncode == 0, result.stderr
    [server] = {tree[rank_pid(run, rank)][0] for rank in (0, 1)}
    assert tree[server][0] == launcher[0]
    assert "warm_starts.py" in tree[server][1] and " -c " not in tree[server][1]
