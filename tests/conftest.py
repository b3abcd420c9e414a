import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# One CPU thread per process, here and in every process a test starts (torch reads
# OMP_NUM_THREADS when it starts): the three pytest workers, their ranks and their runs share 2
# cores, and a thread pool of 2 beside another worker's busy process waits for the thread that
# lost its core at every op (a ResNet docs line took 25 s so, 12 s on one thread). What dpt does
# for the ranks of a world on one CPU (dpt/loop/train.py: limit_cpu_threads); the runs in this
# process already run on one (tests.helpers.one_thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MLflow 3's server starts 7 job-runner processes of its own (GenAI scorers, trace rollups: none
# of dpt's business), each importing mlflow: 25 s of a core per server here. The servers the tests
# start (tests/trackers_read.py, the tracking guide's `mlflow ui`) run without them.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# And `mlflow ui` / `mlflow server` serve with 4 uvicorn workers by default, each importing
# mlflow (5 s of a core each): one serves a test's few requests.
os.environ.setdefault("MLFLOW_WORKERS", "1")

from tests import netns, warm_starts, worlds
from tests.helpers import dpt_logger_kept
from tests.session_runs import SHARED_RUNS, mlflow_uri, session_sweep  # noqa: F401
from tests.slurm_fixture import slurm_cluster  # noqa: F401  (one cluster for the session)

torch.set_num_threads(1)


@pytest.fixture
def two_hosts() -> Iterator[netns.TwoHosts]:
    """Two network namespaces with their own addresses; always torn down."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    name = f"dpt{os.getpid() % 100000}"
    try:
        hosts = netns.up(name)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create network namespaces here: {error.stderr.strip()}")
    try:
        yield hosts
    finally:
        netns.down(name)


@pytest.fixture(autouse=True)
def _dpt_logger_put_back() -> Iterator[None]:
    """A command run in process sets the `dpt` logger up for the whole process: put it back
    after each test (tests.helpers.dpt_logger_kept)."""
    with dpt_logger_kept():
        yield


# The files that take longest, started first: the workers take work units in collection
# order (--no-loadscope-reorder), one whole unit at a time, so a long unit left for last keeps one
# worker busy while the others have nothing left to do. A unit is a file (--dist loadfile), but for
# the files that read the session's sweep and MLflow server (tests/session_runs.py): one unit, so
# one worker builds them once. The seconds are measured, not kept by hand:
# `python scripts/test_costs.py order JUNIT` writes them from a suite run's JUnit XML (.ci/run
# writes one). A file not measured yet goes first: it may be long.
DURATIONS = Path(__file__).with_name("durations.json")
SHARED_UNIT = "tests/session_runs"


def _unit(file: str) -> str:
    """The work unit of a test file (a path): the file itself, or the shared runs' unit."""
    return SHARED_UNIT if Path(file).name in SHARED_RUNS else file


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unit_seconds: dict[str, float] = {}
    for path in {item.path for item in items}:
        unit = _unit(str(path))
        unit_seconds[unit] = unit_seconds.get(unit, 0.0) + seconds.get(path.name, float("inf"))
    # stable: a unit's files stay together, each file's tests in their order
    items.sort(key=lambda item: (-unit_seconds[_unit(str(item.path))], _unit(str(item.path))))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadfile, with the files of SHARED_RUNS as one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(super()._split_scope(nodeid))

    return SharedRunsTogether(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """This worker's resident worlds (tests/worlds.py) and warm-start server
    (tests/warm_starts.py) end with its session."""
    worlds.close_all()
    warm_starts.close()
