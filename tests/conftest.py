import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import netns
from tests.helpers import dpt_logger_kept
from tests.slurm_fixture import slurm_cluster  # noqa: F401  (one cluster for the session)


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


# The files that take longest (measured with --durations), started first: the two workers take
# files in collection order (--no-loadscope-reorder), one whole file at a time (--dist loadfile),
# so a long file left for last keeps one worker busy while the other has nothing left to do.
# Beside the learning test (two ranks busy for minutes) the other worker first runs the files
# that mostly wait (for a timeout, a pulled link, SLURM's scheduler): the cores stay busy.
LONGEST_FIRST = (
    "test_language_model_learns.py",  # one 6,000-step run: about 2 minutes
    "test_faults.py",
    "test_network.py",
    "test_slurm.py",
    "test_soak.py",
    "test_docs_commands.py",
    "test_monitor_runs.py",
    "test_pipeline_runs.py",
    "test_task_readme.py",
    "test_search_runs.py",
    "test_shards_runs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order
