"""What a test session builds once and many tests read (one run, many checks): one MLflow
server, and one sweep of every strategy to every logger, started as a user starts it.

The sweep, `python train.py -m strategy=ddp,fsdp,pipeline,single logger=[tensorboard,mlflow,
wandb,csv] ...` from a fresh folder into Hydra's own sweep folder (`multirun/<date>/<time>`),
serves the summary and the jobs' folders (tests/test_sweeps.py), what TensorBoard shows of it
(tests/test_tensorboard.py), and the MLflow parent and child runs, W&B's offline files and the
CSVs (tests/test_trackers.py). Those files are one work unit of the test scheduler
(tests/conftest.py: SHARED_RUNS), so that the one pytest worker that runs them builds the sweep
and the server once, for all of them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import FAST, TRAIN, Result, hydra_sweep, run_cmd
from tests.trackers_read import mlflow_server

# The files whose tests read these runs: one work unit, one worker (tests/conftest.py).
SHARED_RUNS = (
    "test_sweeps.py",
    "test_tensorboard.py",
    "test_trackers.py",
    "test_validation_schedule.py",
)

STRATEGIES = ("ddp", "fsdp", "pipeline", "single")  # jobs 0 to 3; 2 ranks each but single
STEPS, LOG_EVERY = 4, 2  # two points of each curve: steps 2 and 4
ALL_LOGGERS = "logger=[tensorboard,mlflow,wandb,csv]"


@dataclass(frozen=True)
class Sweep:
    folder: Path  # the sweep's folder: <cwd>/multirun/<date>/<time>
    result: Result  # what `train.py -m` printed
    uri: str  # the MLflow server it logged to


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` with a SQLite store on loopback, for the session."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as (uri, _):
        yield uri


@pytest.fixture(scope="session")
def session_sweep(mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """The sweep of every strategy to every logger, started from a fresh folder."""
    root = tmp_path_factory.mktemp("session_sweep")
    cmd = [sys.executable, str(TRAIN), "-m", *FAST, f"trainer.max_steps={STEPS}",
           f"trainer.log_every_n_steps={LOG_EVERY}", f"strategy={','.join(STRATEGIES)}",
           ALL_LOGGERS, f"logger.mlflow.tracking_uri={mlflow_uri}"]  # fmt: skip
    result = run_cmd(cmd, timeout=300, cwd=root)
    return Sweep(hydra_sweep(root), result, mlflow_uri)
