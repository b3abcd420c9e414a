"""Smoke test for scripts/slurm_local.sh: a real single-machine SLURM cluster driven by submitit.

Needs root and apt (Debian): the fixture installs slurm-wlm + munge if missing and starts the
daemons. Where that is impossible the tests FAIL (so CI can never silently skip them) unless
DPT_SKIP_SLURM=1 is set, which skips them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import UncompletedJobError

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
STATE_DIR = os.environ.get("DPT_SLURM_STATE_DIR", "/tmp/dpt-slurm")
_EXPORT = re.compile(r"^export (\w+)=(.*)$")


def _unavailable_reason() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "scripts/slurm_local.sh needs root to install and run the SLURM daemons"
    binaries = ("slurmctld", "slurmd", "sbatch", "munged")
    if not all(shutil.which(b) for b in binaries) and shutil.which("apt-get") is None:
        return "SLURM is not installed and apt-get is unavailable to install it"
    return None


def _run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args, STATE_DIR],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start the local cluster (unless already up) and export SLURM_CONF + the sacct shim."""
    if os.environ.get("DPT_SKIP_SLURM") == "1":
        pytest.skip("DPT_SKIP_SLURM=1")
    reason = _unavailable_reason()
    if reason is not None:
        pytest.fail(f"{reason} (set DPT_SKIP_SLURM=1 to skip the slurm tests)")
    already_up = _run_script("status", timeout=30).returncode == 0
    proc = _run_script("start", timeout=110)
    if proc.returncode != 0:
        pytest.fail(f"slurm_local.sh start failed:\n{proc.stdout}\n{proc.stderr}")
    env = {}
    for line in proc.stdout.splitlines():
        match = _EXPORT.match(line.strip())
        if match:
            env[match.group(1)] = match.group(2).replace("$PATH", os.environ.get("PATH", ""))
    assert "SLURM_CONF" in env and "PATH" in env, proc.stdout
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env
    if not already_up:
        stop = _run_script("stop", timeout=60)
        assert stop.returncode == 0, stop.stderr


def _executor(folder: Path) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(
        nodes=1, tasks_per_node=2, cpus_per_task=1, timeout_min=2, name="dpt-slurm-smoke"
    )
    return executor


@pytest.mark.timeout(120)
def test_two_tasks_get_slurm_env(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
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
def test_cancelled_job_raises(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
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
