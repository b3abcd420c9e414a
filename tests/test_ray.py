"""The clusters guide's Ray lines (```bash ray), run word for word from a fresh folder: a head
on loopback (in a RAY_TMPDIR of the test's own; stopped after, by its processes: each has that
folder in its environment) and a sweep of two jobs on it, one after the other, each 2 Ray Train
workers under ddp. The cluster's processes get tests/ray_site on their path, which makes rank 1
of the first job SIGKILL itself at step 60 (after the checkpoints of steps 25 and 50): Ray
restarts the group and the run resumes in its own folder. Each job ends equal to one process on
the same global batch; the sweep ends with its summary. A cluster that cannot be reached is one
line before any job."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    TRAIN,
    docs_block,
    free_port,
    hydra_sweep,
    load_weights,
    max_abs_diff,
    run_docs_block,
    run_here,
    summary,
    train_in_process,
)

ray = pytest.importorskip("ray")  # dpt[ray]: scripts/setup.sh installs it

KILL_CALL = 60  # rank 1's 60th training forward: step 60, after step 50's checkpoint
# Ray Train's helpers that watch for a node's drain and keep the dashboard's state: a process
# each per job that this cluster of one machine has no use for.
RAY_TRAIN = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # a dead worker seen at once
             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
             "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0"}  # fmt: skip


def _processes_of(folder: str) -> list[int]:
    """The cluster's processes: every one has `folder` in its environment (RAY_TMPDIR, or the
    kill's marker where Ray gives its agents an environment of its own)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and folder.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


@pytest.fixture
def ray_folder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The environment the guide's lines run in: Ray's temporary folder (short: Ray's socket
    paths), the kill on the cluster's path, Ray Train's helpers off; every process started with
    it is killed after."""
    folder = tempfile.mkdtemp(prefix="dray", dir="/tmp")
    path = os.pathsep.join([str(REPO / "tests" / "ray_site"), str(REPO)])
    for key, value in {"RAY_TMPDIR": folder, "PYTHONPATH": path, **RAY_TRAIN,
                       "DPT_TEST_KILL_RANK": "1", "DPT_TEST_KILL_CALL": str(KILL_CALL),
                       "DPT_TEST_KILL_MARKER": f"{folder}/killed"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        yield Path(folder)
    finally:
        for pid in _processes_of(folder):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # a Ray cluster, three worker groups
@pytest.mark.timeout(400)
def test_the_guides_ray_sweep_equals_one_process_and_resumes_a_killed_worker(
    ray_folder: Path, tmp_path: Path
) -> None:
    start, sweep_line = docs_block("ray")
    assert start.startswith("ray start --head --node-ip-address=127.0.0.1 ")  # on loopback
    root = tmp_path / "clone"
    root.mkdir()
    (root / "train.py").symlink_to(TRAIN)
    _, results = run_docs_block("ray", root)
    sweep = hydra_sweep(root)
    summary_line = f"[sweep] summary: {sweep.relative_to(root) / 'summary.csv'}"
    assert summary_line in results[sweep_line].stdout
    assert [row["status"] for row in summary(sweep)] == ["COMPLETED", "COMPLETED"]
    assert (ray_folder / "killed").exists()  # job 0's rank 1 was killed
    log = (sweep / "0" / "logs" / "rank0.log").read_text()
    assert "resumed from" in log and "world size 2" in log, log  # its newest checkpoint
    assert "resumed from" not in (sweep / "1" / "logs" / "rank0.log").read_text()
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]
    for job, lr in enumerate(("0.01", "0.02")):  # one process on the global batch of 2 x 64
        run_here(tmp_path / lr, "optimizer=sgd", f"optimizer.lr={lr}", "trainer.max_steps=100",
                 "trainer.batch_size=128", "checkpoint.enabled=false")  # fmt: skip
        # As if never killed: the resumed run is the uninterrupted one's (< 1e-6).
        bound = 1e-6 if job == 0 else 1e-5
        assert max_abs_diff(load_weights(sweep / str(job)), load_weights(tmp_path / lr)) < bound


@pytest.mark.timeout(60)
def test_a_cluster_that_cannot_be_reached_is_one_line_before_any_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()  # nothing listens there
    result = train_in_process("launcher=ray", f"launcher.address=127.0.0.1:{port}",
                              f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: launcher.address=127.0.0.1:{port}: no Ray cluster answers there (Connection "
        f"refused); start one (ray start --head --port={port}) or name a running cluster's head"
    )
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster was started from here
    result = train_in_process("launcher=ray", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: launcher.address=auto: no Ray cluster found (RAY_ADDRESS is not set and none "
        "was started on this machine); start one (ray start --head), name its head "
        "(launcher.address=host:port), or let the job start its own (launcher.address=local)"
    )
