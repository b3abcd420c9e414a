"""Soak: 4 ddp jobs of 2 ranks at once (joblib), each its own world, port, folder and metrics:
8 ranks and 4 job processes on 2 cores, more than the machine has, as a busy node has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import hydra_sweep, job_tb, summary
from tests.test_sweeps import SHORT_STEPS, multirun

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

JOBS = 4
PORT = re.compile(r"backend gloo at [\w.]+:(\d+)")


def _loss_steps(folder: Path) -> list[int]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


@pytest.mark.timeout(600)
def test_four_ddp_jobs_at_once(tmp_path: Path) -> None:
    seeds = ",".join(str(s) for s in range(1, JOBS + 1))
    multirun(
        tmp_path,
        "hydra/launcher=joblib",
        f"hydra.launcher.n_jobs={JOBS}",
        "strategy=ddp",
        "trainer.batch_size=16",
        "trainer.log_every_n_steps=1",
        f"trainer.seed={seeds}",
        "dataset.num_val_samples=0",
        "checkpoint.enabled=false",
        timeout=580,
    )
    sweep = hydra_sweep(tmp_path)
    rows = summary(sweep)
    assert [r["status"] for r in rows] == ["COMPLETED"] * JOBS
    ports = set()
    rank_logs = 0
    for job in range(JOBS):
        job_dir = sweep / str(job)
        logs = sorted(p.name for p in (job_dir / "logs").iterdir())
        assert logs == ["rank0.log", "rank1.log"]
        rank_logs += len(logs)
        found = {PORT.search((job_dir / "logs" / log).read_text()).group(1) for log in logs}
        assert len(found) == 1  # both ranks of a job met at one address...
        ports |= found
        for folder in ("rank0", "rank1", "world"):  # ...and no metric point was lost
            assert _loss_steps(job_tb(sweep, job) / folder) == list(range(1, SHORT_STEPS + 1))
    assert rank_logs == 2 * JOBS
    assert len(ports) == JOBS  # ...and no two jobs shared one
