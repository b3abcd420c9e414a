"""`python train.py -m ...`: every job its own world and folder, and a summary of the sweep.

Sweeps run from a fresh folder with Hydra's own sweep folder (`multirun/<date>/<time>`, no
hydra.sweep.dir), as a user starts them: a job's ranks must not read Hydra's `${now:...}` again.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from dpt.launch.sweep import STATUS_FILE, report, write_status
from tests.helpers import (
    FAST,
    REPO,
    TRAIN,
    Result,
    hydra_sweep,
    job_tb,
    run_cmd,
    summary,
)
from tests.session_runs import Sweep

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

SHORT_STEPS = 5
SHORT = [*FAST, f"trainer.max_steps={SHORT_STEPS}"]
# `best`: the job with the best objective (here val/loss), its run folder linked.
SWEEP_FILES = {"multirun.yaml", "summary.csv", "summary.png", "tb", "best"}
SWEEPS_GUIDE = REPO / "docs" / "guides" / "sweeps.md"
JOBLIB_LINE = "python train.py -m hydra/launcher=joblib hydra.launcher.n_jobs=2 strategy=ddp"


def multirun(folder: Path, *overrides: str, timeout: float = 150, check: bool = True) -> Result:
    """`train.py -m` started in `folder`: its sweep is `hydra_sweep(folder)`."""
    cmd = [sys.executable, str(TRAIN), "-m", *SHORT, *overrides]
    return run_cmd(cmd, timeout=timeout, cwd=folder, check=check)


def status(job_dir: Path) -> dict:
    return json.loads((job_dir / STATUS_FILE).read_text())


def ranks_in(sweep: Path, job: int) -> tuple[list[str], list[str]]:
    logs = sorted(p.name for p in (sweep / str(job) / "logs").iterdir())
    tb = sorted(p.name for p in job_tb(sweep, job).iterdir())
    return logs, tb


def skip_if_mps() -> None:
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        pytest.skip("these tests make a job fail with trainer.device=mps")


@pytest.mark.timeout(420)
def test_a_sweep_of_every_multi_process_strategy_then_single(session_sweep: Sweep) -> None:
    """ddp, fsdp and pipeline jobs (2 ranks each), then a single one: it would fail on a
    leftover RANK or WORLD_SIZE; each rank names its TensorBoard folder as the sweep does. (The
    session's sweep, tests/session_runs.py, which logs to every tracker too.)"""
    sweep = session_sweep.folder
    # trackers.json: the sweep's MLflow run, the parent of its jobs' runs
    assert {p.name for p in sweep.iterdir()} == {"0", "1", "2", "3", *SWEEP_FILES, "trackers.json"}
    one = (["rank0.log"], ["rank0", "world"])
    two = (["rank0.log", "rank1.log"], ["rank0", "rank1", "world"])
    assert [ranks_in(sweep, job) for job in range(4)] == [two, two, two, one]
    assert sorted(p.name for p in (sweep / "tb").iterdir() if p.is_dir()) == [
        "0 strategy=ddp", "1 strategy=fsdp", "2 strategy=pipeline", "3 strategy=single",
    ]  # fmt: skip
    rows = summary(sweep)
    assert [(r["job"], r["status"], r["world_size"]) for r in rows] == [
        ("0", "COMPLETED", "2"),
        ("1", "COMPLETED", "2"),
        ("2", "COMPLETED", "2"),
        ("3", "COMPLETED", "1"),
    ]
    for row in rows:
        assert float(row["final_loss"]) > 0 and float(row["loop_samples_per_s"]) > 0
        assert float(row["best_val/acc1"]) > 0 and float(row["job_wall_s"]) > 0
    # The pipeline's two stages train one replica's batch: the single job's run, to float noise.
    assert float(rows[2]["final_loss"]) == pytest.approx(float(rows[3]["final_loss"]), abs=1e-5)
    assert (sweep / "summary.png").stat().st_size > 1000
    # One console format: Hydra's own lines as `[sweep] ...`, not `[<date> <time>][HYDRA] ...`.
    lines = session_sweep.result.stdout.splitlines()
    assert "[sweep] Launching 4 jobs locally" in lines
    assert not [line for line in lines if "[HYDRA]" in line], session_sweep.result.stdout


@pytest.mark.timeout(240)
def test_the_guides_joblib_sweep_runs_two_ddp_jobs_at_once(tmp_path: Path) -> None:
    """The sweeps guide's joblib line, exactly as printed, from a fresh folder."""
    line = next(c.split(" # ")[0].strip() for c in SWEEPS_GUIDE.read_text().splitlines()
                if c.startswith(JOBLIB_LINE))  # fmt: skip
    (tmp_path / "train.py").symlink_to(TRAIN)
    args = shlex.split(line)
    run_cmd([sys.executable, *args[1:]], timeout=200, cwd=tmp_path)
    sweep = hydra_sweep(tmp_path)
    assert {p.name for p in sweep.iterdir()} == {"0", "1", *SWEEP_FILES}
    for job in range(2):
        assert ranks_in(sweep, job) == (["rank0.log", "rank1.log"], ["rank0", "rank1", "world"])
    assert [(r["status"], r["world_size"]) for r in summary(sweep)] == [("COMPLETED", "2")] * 2
    first, second = status(sweep / "0"), status(sweep / "1")
    overlap = min(first["ended_at"], second["ended_at"]) - max(
        first["started_at"], second["started_at"]
    )
    assert overlap > 0, "the two jobs did not run at the same time"


@pytest.mark.timeout(120)
def test_failed_job_is_listed_and_the_next_jobs_run(tmp_path: Path) -> None:
    """Job 1 fails while it starts training (no MPS here); jobs 0 and 2 run; exit status 1."""
    skip_if_mps()
    result = multirun(tmp_path, "trainer.device=cpu,mps,auto", check=False)
    sweep = hydra_sweep(tmp_path)
    assert result.returncode == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: 1 of 3 jobs failed (first: job 1: trainer.device=mps: MPS is")
    rows = summary(sweep)
    assert [r["status"] for r in rows] == ["COMPLETED", "FAILED", "COMPLETED"]
    assert "trainer.device=mps: MPS is not available" in rows[1]["error"]
    assert rows[1]["final_loss"] == "" and float(rows[2]["final_loss"]) > 0
    assert status(sweep / "2")["result"]["steps"] == 5


@pytest.mark.timeout(120)
def test_stop_on_failure_ends_the_sweep_at_the_first_failed_job(tmp_path: Path) -> None:
    skip_if_mps()
    result = multirun(
        tmp_path, "hydra.callbacks.summary.stop_on_failure=true", "trainer.device=mps,cpu",
        check=False,
    )  # fmt: skip
    sweep = hydra_sweep(tmp_path)
    assert result.returncode == 1, result.output
    assert "sweep stopped (hydra.callbacks.summary.stop_on_failure=true)" in result.stderr
    assert not (sweep / "1").exists()
    assert [(r["job"], r["status"]) for r in summary(sweep)] == [("0", "FAILED")]


@pytest.mark.timeout(60)
def test_a_job_that_never_reported_its_end_is_listed_as_crashed(tmp_path: Path) -> None:
    """A job killed before its on_job_end (OOM, SIGKILL) leaves its RUNNING status behind."""
    write_status(tmp_path / "0", {"job": 0, "overrides": ["a=1"], "status": "RUNNING"})
    finished = {"job": 1, "overrides": ["a=2"], "status": "COMPLETED", "error": None}
    write_status(tmp_path / "1", {**finished, "result": {"final_loss": 0.5, "samples_per_s": 9}})
    records = report(tmp_path, final=True)
    assert [(r["job"], r["status"]) for r in records] == [(0, "CRASHED"), (1, "COMPLETED")]
    assert [r["status"] for r in summary(tmp_path)] == ["CRASHED", "COMPLETED"]
