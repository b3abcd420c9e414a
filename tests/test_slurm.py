"""The real local SLURM cluster (scripts/slurm_local.sh, from tests/slurm_fixture.py: root and
apt needed; DPT_SKIP_SLURM=1 skips): first the cluster itself driven by submitit, then
`python train.py -m launcher=slurm ...` against it (a job cancelled while it trains: in the
sweep's test of failed, cancelled and requeued jobs). One file, so that pytest-xdist runs every
SLURM test in one worker, against the one cluster they share.

Each job of the sweep is one SLURM job with one task per rank; the sweep summary lists every job,
also those that failed, were cancelled or were requeued while the others ran on.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import submitit

from tests.helpers import FAST, TRAIN, hydra_sweep, run_cmd, summary

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

SLURM = ["launcher=slurm", "launcher.cpus_per_task=1", "launcher.time=5", *FAST]


@pytest.mark.timeout(240)
def test_sweep_of_two_task_ddp_and_fsdp_jobs(tmp_path: Path) -> None:
    """From a fresh folder, in Hydra's own sweep folder (`multirun/<date>/<time>`): every task
    of a job writes into the sweep's folders as the process that submitted it named them."""
    result = run_cmd(
        [
            sys.executable,
            str(TRAIN),
            "-m",
            *SLURM,
            "launcher.tasks_per_node=2",
            "strategy=ddp,fsdp",  # both distributed strategies, as SLURM jobs of 2 tasks
            "trainer.max_steps=5",
            # A task that wrote Hydra's files would leave .hydra_<its SLURM_PROCID>.
            "hydra.output_subdir=.hydra_${oc.env:SLURM_PROCID,none}",
        ],
        timeout=200,
        cwd=tmp_path,
    )
    sweep = hydra_sweep(tmp_path)
    assert sorted(p.name for p in (sweep / "tb").iterdir() if p.is_dir()) == [
        "0 strategy=ddp", "1 strategy=fsdp",
    ]  # fmt: skip
    rows = summary(sweep)
    assert [(r["job"], r["status"], r["world_size"]) for r in rows] == [
        ("0", "COMPLETED", "2"),
        ("1", "COMPLETED", "2"),
    ]
    assert "strategy=fsdp" in rows[1]["overrides"]
    for job in ("0", "1"):
        job_dir = sweep / job
        assert sorted(p.name for p in (job_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
        assert "[rank 1]" in (job_dir / "logs" / "rank1.log").read_text()
        assert (job_dir / ".hydra_0" / "config.yaml").is_file()
        assert not list(job_dir.glob(".hydra_[!0]*")), "a task > 0 wrote Hydra's files"
        assert (job_dir / "model.pt").is_file()
    assert "COMPLETED" in result.stdout


@pytest.mark.timeout(240)
def test_a_search_runs_its_trials_as_slurm_jobs(tmp_path: Path) -> None:
    """hydra/sweeper=optuna over dpt's SLURM launcher: two trials submitted together, each told
    its job's objective."""
    sweep = tmp_path / "sweep"
    run_cmd([sys.executable, str(TRAIN), "-m", *SLURM, "launcher.tasks_per_node=1",
             "trainer.max_steps=3", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
             "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=0",
             "optimizer.lr=tag(log,interval(1e-4,1e-1))", f"hydra.sweep.dir={sweep}"],
            timeout=200)  # fmt: skip
    import optuna

    study = optuna.load_study(study_name="dpt", storage=f"sqlite:///{sweep / 'optuna.db'}")
    values = {t.number: t.value for t in study.trials}
    rows = summary(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "COMPLETED"), ("1", "COMPLETED")]
    assert {int(r["job"]): float(r["objective"]) for r in rows} == values
    assert list((sweep / ".submitit").iterdir()), "not run through SLURM"


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def scontrol_ok(*args: str) -> bool:
    return subprocess.run(["scontrol", *args], capture_output=True, timeout=30).returncode == 0


def requeue_now(job_id: str) -> None:
    """What a preemption with PreemptMode=REQUEUE does: the job is stopped and queued again.

    SLURM holds a requeued job back for two minutes (its BeginTime); let it start at once.
    """
    assert scontrol_ok("requeue", job_id)
    wait_for(lambda: job_state(job_id) == "PENDING", 60, f"job {job_id} to be queued again")
    assert scontrol_ok("update", f"JobId={job_id}", "StartTime=now")


def job_state(job_id: str) -> str:
    squeue = ["squeue", "-h", "-j", job_id, "-o", "%T"]
    return subprocess.run(squeue, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.mark.timeout(300)
def test_failed_cancelled_and_requeued_jobs(tmp_path: Path) -> None:
    """Job 0 fails inside its task; job 1 is requeued while it trains and resumes in its own
    folder; job 2 is cancelled while it trains. The sweep waits for all of them and lists all.
    """
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(TRAIN),
        "-m",
        *SLURM,
        "trainer.max_steps=0,300,100000",
        "trainer.epochs=1000",
        f"hydra.sweep.dir={sweep}",
    ]
    log1 = sweep / "1" / "logs" / "rank0.log"
    with ThreadPoolExecutor(1) as pool:
        sweep_run = pool.submit(run_cmd, cmd, timeout=250, check=False)
        try:
            wait_for(lambda: log1.is_file() and "epoch 2 done" in log1.read_text(), 120, "job 1")
            ids = {p.name[-1]: p.name for p in (sweep / ".submitit").glob("*_[12]")}
            subprocess.run(["scancel", ids["2"]], check=True, timeout=30)
            requeue_now(ids["1"])
        except BaseException:  # leave no job training for 1000 epochs behind
            arrays = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("[0-9]*_*")}
            subprocess.run(["scancel", *arrays], timeout=30, check=False)
            raise
        result = sweep_run.result()
    assert result.returncode == 1, result.output
    assert "2 of 3 jobs failed" in result.stderr
    rows = summary(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED", "FAILED"]
    assert rows[0]["error"].startswith("trainer.max_steps=0: must be >= 1")
    assert f"SLURM job {ids['2']} ended without a result (CANCELLED)" in rows[2]["error"]
    # The requeued run started again in job 1's folder and resumed from its newest checkpoint.
    assert rows[1]["steps"] == "300" and rows[1]["job_dir"] == "1"
    log = log1.read_text()
    assert log.count("world size 1") == 2 and "resumed from" in log


# --- the cluster itself, through submitit --------------------------------------------------------


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
