"""The garbage collector around a rank's run: off while it starts, start-up frozen for training."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dpt.launch import launchers as launch
from dpt.loop import collector
from dpt.loop.trainer import Trainer
from tests.helpers import compose


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    """Every test starts and leaves with the collector on and nothing frozen (an in-process
    run of another test file in the same pytest worker may have frozen its objects)."""
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[_Cycle]:
    """A cycle no one refers to: only a collection frees it."""
    return weakref.ref(_Cycle())


def test_off_while_starting_then_on_with_start_up_frozen() -> None:
    with collector.off_during_startup():
        assert not gc.isenabled()
        left = _garbage_cycle()
        collector.freeze_for_training()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        gc.collect()
        assert left() is not None  # frozen: no collection looks at it, not even a full one
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off() -> None:
    gc.disable()
    with collector.off_during_startup():
        collector.freeze_for_training()
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_next_job_of_a_sweep_frees_what_the_last_one_left() -> None:
    left = _garbage_cycle()
    collector.freeze_for_training()  # job 1
    assert left() is not None
    collector.freeze_for_training()  # job 2, same process
    assert left() is None


@pytest.mark.timeout(120)
def test_a_rank_trains_with_start_up_frozen_and_ends_with_collection_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}
    fit = Trainer.fit

    def observed(trainer: Trainer) -> object:
        seen["frozen"], seen["enabled"] = gc.get_freeze_count(), gc.isenabled()
        return fit(trainer)

    def built(*args: object) -> object:  # start-up: the parts are built with no collection
        seen["enabled_while_building"] = gc.isenabled()
        return build_parts(*args)

    from dpt.loop import train

    build_parts = train.build_parts
    monkeypatch.setattr(Trainer, "fit", observed)
    monkeypatch.setattr(train, "build_parts", built)
    cfg = compose("trainer.max_steps=3", "dataset.num_val_samples=0", "checkpoint.enabled=false")
    summary = launch.run_worker(OmegaConf.to_container(cfg, resolve=True), str(tmp_path))
    assert summary["steps"] == 3
    assert seen["enabled_while_building"] is False and seen["enabled"] is True
    assert int(seen["frozen"]) > 10_000  # torch's modules, the parts: start-up's objects
    assert gc.isenabled()
