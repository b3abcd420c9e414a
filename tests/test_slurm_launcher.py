"""`python train.py -m launcher=slurm ...` against the real local SLURM cluster.

Each job of the sweep is one SLURM job with one task per rank; the sweep summary lists every job,
also those that failed or were cancelled while the others ran on.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import FAST, TRAIN, run_cmd
from tests.slurm_fixture import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

SLURM = ["launcher=slurm", "launcher.cpus_per_task=1", "launcher.time=5", *FAST]


def summary(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(240)
def test_sweep_of_two_task_ddp_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_cmd(
        [
            sys.executable,
            str(TRAIN),
            "-m",
            *SLURM,
            "launcher.tasks_per_node=2",
            "strategy=ddp",
            "trainer.seed=1,2",
            "trainer.max_steps=5",
            f"hydra.sweep.dir={sweep}",
            # A task that wrote Hydra's files would leave .hydra_<its SLURM_PROCID>.
            "hydra.output_subdir=.hydra_${oc.env:SLURM_PROCID,none}",
        ],
        timeout=200,
    )
    rows = summary(sweep)
    assert [(r["job"], r["status"], r["world_size"]) for r in rows] == [
        ("0", "COMPLETED", "2"),
        ("1", "COMPLETED", "2"),
    ]
    assert "trainer.seed=2" in rows[1]["overrides"]
    for job in ("0", "1"):
        job_dir = sweep / job
        assert sorted(p.name for p in (job_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
        assert "[rank 1]" in (job_dir / "logs" / "rank1.log").read_text()
        assert (job_dir / ".hydra_0" / "config.yaml").is_file()
        assert not list(job_dir.glob(".hydra_[!0]*")), "a task > 0 wrote Hydra's files"
        assert (job_dir / "model.pt").is_file()
    assert "COMPLETED" in result.stdout


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():  # type: ignore[operator]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.timeout(240)
def test_failed_and_cancelled_jobs_are_listed(tmp_path: Path) -> None:
    """Job 0 fails inside its task; job 1 is cancelled while it trains; the sweep still ends."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(TRAIN),
        "-m",
        *SLURM,
        "trainer.device=mps,cpu",
        "trainer.epochs=1000",
        f"hydra.sweep.dir={sweep}",
    ]
    with ThreadPoolExecutor(1) as pool:
        sweep_run = pool.submit(run_cmd, cmd, timeout=200, check=False)
        try:
            status = sweep / "1" / "job_status.json"
            wait_for(lambda: status.is_file() and "RUNNING" in status.read_text(), 120, "job 1")
            (job_id,) = [p.name for p in (sweep / ".submitit").glob("*_1")]
            subprocess.run(["scancel", job_id], check=True, timeout=30)
        except BaseException:  # leave no job training for 1000 epochs behind
            arrays = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("*_*")}
            subprocess.run(["scancel", *arrays], timeout=30, check=False)
            raise
        result = sweep_run.result()
    assert result.returncode == 1, result.output
    assert "2 of 2 jobs failed" in result.stderr
    rows = summary(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "FAILED"), ("1", "FAILED")]
    assert "trainer.device=mps: MPS is not available" in rows[0]["error"]
    assert f"SLURM job {job_id} ended without a result (CANCELLED)" in rows[1]["error"]
