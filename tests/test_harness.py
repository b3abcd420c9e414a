"""The suite's own helpers for runs hosted in a process that hosts many (a pytest worker, a
resident rank): the process is left as a fresh one would be for the next run (the collector's
freeze undone, the run's loader workers ended), and what was there before is left alone."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from tests.helpers import FAST, _children, collector_as_found, loader_workers_ended, run_here


def _loader() -> DataLoader:
    return DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                      multiprocessing_context="fork")  # fmt: skip


@pytest.mark.timeout(60)
def test_the_blocks_loader_workers_end_with_it_and_earlier_ones_stay() -> None:
    """The process's other children (a pytest worker's resident ranks) are left alone too."""
    others = _children()
    kept = iter(_loader())
    next(kept)
    earlier = _children() - others  # the earlier loader's 2 workers
    assert len(earlier) == 2
    try:
        with loader_workers_ended():
            started = iter(_loader())
            next(started)
            assert len(_children() - others - earlier) == 2  # the block's loader's workers
        assert _children() - others == earlier  # ended with the block; the earlier ones run
    finally:
        kept._shutdown_workers()  # type: ignore[attr-defined]
    assert not _children() & earlier


def test_the_collectors_freeze_is_undone_where_the_block_found_none() -> None:
    gc.unfreeze()
    with collector_as_found():
        gc.freeze()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # found frozen: left so
    try:
        with collector_as_found():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.timeout(120)
def test_a_run_here_leaves_nothing_frozen(tmp_path: Path) -> None:
    gc.unfreeze()
    summary, _ = run_here(tmp_path, *FAST, "trainer.max_steps=2", "checkpoint.enabled=false")
    assert summary["steps"] == 2
    assert gc.get_freeze_count() == 0  # the next run starts as in a fresh process
