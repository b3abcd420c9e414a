"""Smoke test for scripts/slurm_local.sh: a real single-machine SLURM cluster driven by submitit.

The cluster comes from tests/slurm_fixture.py (root and apt needed; DPT_SKIP_SLURM=1 skips).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import UncompletedJobError

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def _executor(folder: Path) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    # Not shorter: submitit asks SLURM for SIGUSR2 90 s before the time limit, and with a 2-minute
    # limit that signal could end the job while the test still waits for it to run.
    executor.update_parameters(
        nodes=1, tasks_per_node=2, cpus_per_task=1, timeout_min=10, name="dpt-slurm-smoke"
    )
    return executor


@pytest.mark.timeout(120)
def test_two_tasks_get_slurm_env(tmp_path: Path) -> None:
    def task_env() -> dict[str, str]:  # local function: cloudpickled by value into the job
        import os

        keys = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")
        return {key: os.environ.get(key, "") for key in keys}

    job = _executor(tmp_path).submit(task_env)
    results = job.results()
    assert len(results) == 2
    assert sorted(r["SLURM_PROCID"] for r in results) == ["0", "1"]
    assert sorted(r["SLURM_LOCALID"] for r in results) == ["0", "1"]
    assert all(r["SLURM_NTASKS"] == "2" for r in results)
    assert all(r["SLURM_JOB_NODELIST"] for r in results)


@pytest.mark.timeout(120)
def test_cancelled_job_raises(tmp_path: Path) -> None:
    job = _executor(tmp_path).submit(time.sleep, 300)
    deadline = time.time() + 30
    while job.state != "RUNNING" and time.time() < deadline:
        time.sleep(0.5)
    assert job.state == "RUNNING"
    job.cancel()
    start = time.time()
    with pytest.raises(UncompletedJobError):
        job.result()
    assert time.time() - start < 60
    assert job.state.startswith("CANCELLED")
