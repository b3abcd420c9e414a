"""Small things a first run meets: loader workers sized to the machine, CPU ranks past the cores,
a warmup as long as the run."""

from __future__ import annotations

import logging

import pytest
import torch

from dpt.config.store import cpu_cores
from dpt.errors import DptError
from dpt.launch.launchers import MAX_PROCESSES_PER_CORE, check_cpu_processes
from dpt.loop.schedulers import warmup_cosine
from tests.helpers import compose


def _dataset(option: str, *overrides: str) -> dict[str, object]:
    """Composed as train.py composes it (Hydra's global state cleared around it: a test before
    this one in the same process may have left it set)."""
    return dict(compose(f"dataset={option}", *overrides).dataset)


def test_loader_workers_default_to_at_most_the_cores() -> None:
    assert _dataset("coco", "dataset.root=x")["num_workers"] == min(4, cpu_cores())
    assert _dataset("fake_images")["num_workers"] == min(2, cpu_cores())
    assert _dataset("coco", "dataset.root=x", "dataset.num_workers=7")["num_workers"] == 7


@pytest.fixture
def dpt_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """caplog sees the `dpt` logger (setup_logging stops it from propagating)."""
    monkeypatch.setattr(logging.getLogger("dpt"), "propagate", True)
    return caplog


def test_cpu_ranks_past_the_cores_warn_and_far_past_them_refuse(
    dpt_log: pytest.LogCaptureFixture,
) -> None:
    caplog = dpt_log
    with caplog.at_level(logging.WARNING, logger="dpt"):
        check_cpu_processes(2, cores=2)
        assert not caplog.records
        check_cpu_processes(3, cores=2)
    assert (
        caplog.records[0]
        .getMessage()
        .startswith("launcher.nproc_per_node=3: more processes than the 2 CPU cores here")
    )
    check_cpu_processes(MAX_PROCESSES_PER_CORE * 2, cores=2)
    with pytest.raises(DptError, match=r"nproc_per_node=9: more than 4 CPU processes per core"):
        check_cpu_processes(MAX_PROCESSES_PER_CORE * 2 + 1, cores=2)


def test_a_warmup_as_long_as_the_run_says_so(dpt_log: pytest.LogCaptureFixture) -> None:
    caplog = dpt_log
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with caplog.at_level(logging.WARNING, logger="dpt"):
        warmup_cosine(optimizer, total_steps=200, warmup_steps=100, min_lr=0.0)
        assert not caplog.records
        warmup_cosine(optimizer, total_steps=96, warmup_steps=100, min_lr=0.0)
    assert "never leaves the warmup" in caplog.records[0].getMessage()
