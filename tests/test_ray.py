"""`launcher=ray` on a Ray cluster started here on loopback (`ray start --head`, its own
RAY_TMPDIR; stopped after, by its processes' ids). One sweep of two jobs at once (Hydra's joblib
launcher, as the clusters guide shows), each 2 Ray Train workers under ddp: job 0 equals one
process on the same global batch; job 1 loses rank 1 to a SIGKILL after a checkpoint, Ray
restarts the group, and the run resumes in its own folder to the uninterrupted weights. The
sweep ends with its summary. A cluster that cannot be reached is one line before any job."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    TRAIN,
    free_port,
    load_weights,
    max_abs_diff,
    run_cmd,
    run_here,
    summary,
    train_in_process,
)

ray = pytest.importorskip("ray")  # dpt[ray]: scripts/setup.sh installs it

# Rank 1 of tests.faults.KilledOnceMLP dies at its 5th training forward (after step 4's
# checkpoint of every 2); the variables reach the workers through the cluster's own processes.
KILL = {"DPT_TEST_KILL_RANK": "1", "DPT_TEST_KILL_CALL": "5"}
RUN = ["optimizer=sgd", "optimizer.lr=0.05", "trainer.seed=3", "trainer.max_steps=6",
       "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2"]  # fmt: skip
GLOBAL_BATCH = 32
# Ray Train's helpers that watch for a node's drain and keep the dashboard's state: a process
# each per job that this cluster of one machine has no use for (a tenth of the test's CPU).
RAY_TRAIN = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # a dead worker seen at once
             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
             "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0"}  # fmt: skip


def _cluster_processes(folder: str) -> list[int]:
    """The cluster's processes: every one has its temporary folder in its command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and folder in (proc / "cmdline").read_text(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, Path]]:
    """A head node on 127.0.0.1 with 4 CPUs to place (two jobs of 2 workers; Ray Train's
    controllers take none); its address and the folder the workers' kill marker goes to."""
    folder = tempfile.mkdtemp(prefix="dray", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": folder, "PYTHONPATH": str(REPO), **KILL,
           "DPT_TEST_KILL_MARKER": f"{folder}/killed"}  # fmt: skip
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "start", "--head", "--num-cpus=4", f"--port={port}",
                    "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)  # fmt: skip
    try:
        yield f"127.0.0.1:{port}", Path(folder)
    finally:
        for pid in _cluster_processes(folder):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # a Ray cluster, three worker groups (two at once)
@pytest.mark.timeout(400)
def test_a_ray_sweep_equals_one_process_and_resumes_a_killed_worker(
    cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, folder = cluster
    sweep = tmp_path / "sweep"
    result = run_cmd(
        [sys.executable, str(TRAIN), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "launcher=ray", f"launcher.address={address}",
         "launcher.max_failures=1", "strategy=ddp", f"trainer.batch_size={GLOBAL_BATCH // 2}",
         "model._target_=dpt.models.mlp.MLP,tests.faults.KilledOnceMLP", *RUN,
         f"hydra.sweep.dir={sweep}"],
        timeout=360,
        env={**os.environ, **RAY_TRAIN},
    )  # fmt: skip
    assert f"[sweep] summary: {sweep / 'summary.csv'}" in result.stdout
    assert [row["status"] for row in summary(sweep)] == ["COMPLETED", "COMPLETED"]
    assert (folder / "killed").exists()  # job 1's rank 1 was killed
    log = (sweep / "1" / "logs" / "rank0.log").read_text()
    assert "resumed from" in log, log  # from its newest committed checkpoint
    run_here(tmp_path / "single", *RUN, f"trainer.batch_size={GLOBAL_BATCH}")
    single = load_weights(tmp_path / "single")
    assert max_abs_diff(load_weights(sweep / "0"), single) < 1e-5
    assert max_abs_diff(load_weights(sweep / "1"), single) < 1e-6  # as if never killed
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]


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
