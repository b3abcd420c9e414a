"""Resuming under another config: differences applied and said, or refused in one line; another
run folder's checkpoint recognised. In this process (no ranks started): fast."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from dpt.loop import resume_apply
from dpt.state.checkpoint import Checkpoints, ConfigMismatch, committed
from dpt.state.resume_config import APPLIED, REFUSED, compare, flat
from tests.helpers import build_trainer, compose
from tests.test_checkpoint import CPU1, _parts

SMALL = ["dataset.num_samples=256", "dataset.num_val_samples=0", "trainer.batch_size=32"]


@functools.cache  # the same overrides compose the same config: the tests share the base's
def _yaml(*overrides: str) -> str:
    return OmegaConf.to_yaml(compose(*SMALL, *overrides))


def _written(run: Path, yaml: str, step: int = 5) -> Path:
    """A committed checkpoint at `step`, written under the config `yaml`."""
    ckpts = Checkpoints(run, CPU1, 3, yaml)
    ckpts.resume(None, _parts())
    ckpts.save(_parts(step), step)
    return run / "checkpoints" / f"step-{step:08d}"


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# --- the table ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "applied"),
    [
        ("trainer.max_steps=40", True),
        ("trainer.epochs=7", True),
        ("optimizer.lr=0.05", True),
        ("optimizer.fused=false", True),  # the same state, a loop per tensor instead
        ("trainer.log_every_n_steps=3", True),
        ("checkpoint.keep=9", True),
        ("dataset.num_workers=1", True),
        ("trainer.timeout_s=30", True),
        ("strategy=ddp", True),
        ("trainer.batch_size=16", True),
        ("monitor.loss_spike.threshold=20", True),  # what is watched from now on
        ("monitor.grad_spike.action=rollback", True),
        ("trainer.seed=1", False),
        ("dataset.shuffle=false", False),  # another order of the same samples
        ("dataset.num_samples=512", False),
        ("model.hidden_dims=[8]", False),
        ("optimizer=sgd", False),
        ("scheduler=step", False),
    ],
)
def test_each_difference_is_applied_or_refused(override: str, applied: bool) -> None:
    found = compare(flat(_yaml()), flat(_yaml(override)))
    assert bool(found.refused) is not applied, found
    assert found.applied or found.refused  # the override is a difference at all


@pytest.mark.parametrize(
    ("override", "applied"),
    [
        ("dataset.cache_limit_gb=5", True),
        ("dataset.cache_dir=/elsewhere", True),
        ("dataset.retries=9", True),
        ("dataset.timeout_s=5", True),
        ("dataset.shuffle_window=64", False),  # another order of the same samples
        ("dataset.root=http://host/shards", False),
    ],
)
def test_shards_may_be_fetched_otherwise_not_ordered_otherwise(
    override: str, applied: bool
) -> None:
    shards = ("model=resnet18", "dataset=shards", "dataset.root=/data/shards")
    before = flat(OmegaConf.to_yaml(compose(*shards)))
    found = compare(before, flat(OmegaConf.to_yaml(compose(*shards, override))))
    assert bool(found.refused) is not applied and (found.applied or found.refused), found


def test_a_refused_kind_is_named_before_its_values() -> None:
    found = compare(flat(_yaml()), flat(_yaml("optimizer=sgd")))
    assert found.refused[0].key == "optimizer._target_"


def test_the_table_has_no_entry_both_applied_and_refused() -> None:
    assert not set(APPLIED) & {prefix for prefix, _ in REFUSED}


def test_a_checkpoint_of_before_the_fused_kernel_resumes_on_it() -> None:
    stored = flat(_yaml())
    del stored["optimizer.fused"]  # written before the key was added: its optimizer looped
    found = compare(stored, flat(_yaml()))
    assert not found.refused and [c.key for c in found.applied] == ["optimizer.fused"]


def test_where_the_checkpoint_comes_from_is_not_a_difference() -> None:
    found = compare(flat(_yaml()), flat(_yaml("checkpoint.resume=null")))
    assert found.applied == found.refused == ()


# --- resuming ----------------------------------------------------------------------------------


def test_a_different_seed_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _written(tmp_path, _yaml("trainer.seed=0"))
    with pytest.raises(ConfigMismatch) as refused:
        Checkpoints(tmp_path, CPU1, 3, _yaml("trainer.seed=1")).resume("auto", _parts())
    assert str(refused.value) == (
        f"checkpoint {path} was written with trainer.seed=0, this run has trainer.seed=1: that "
        "changes the data and the initial weights; set checkpoint.strict=false to resume anyway"
    )


def test_switching_optimizer_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _written(tmp_path, _yaml())
    with pytest.raises(ConfigMismatch) as refused:
        Checkpoints(tmp_path, CPU1, 3, _yaml("optimizer=sgd")).resume(str(path), _parts())
    assert str(refused.value) == (
        f"checkpoint {path} was written with optimizer._target_=torch.optim.Adam, this run has "
        "optimizer._target_=torch.optim.SGD: the checkpoint's optimizer state does not fit "
        "another optimizer; set checkpoint.strict=false to resume anyway"
    )


def test_other_refused_keys_are_named_too(tmp_path: Path) -> None:
    _written(tmp_path, _yaml())
    changed = _yaml("trainer.seed=3", "model.hidden_dims=[8]")
    with pytest.raises(ConfigMismatch, match=r"\(also differs: model.hidden_dims\); set"):
        Checkpoints(tmp_path, CPU1, 3, changed).resume("auto", _parts())


def test_strict_false_resumes_anyway_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _written(tmp_path, _yaml())
    parts = _parts()
    forced = Checkpoints(tmp_path, CPU1, 3, _yaml("trainer.seed=1", "checkpoint.strict=false"))
    start = forced.resume("auto", parts)
    assert start is not None and start.step == 5 and parts["progress"].part.step == 5
    assert (
        f"checkpoint.strict=false: resuming from {path} despite trainer.seed 0 -> 1 (that "
        "changes the data and the initial weights)"
    ) in _messages(caplog, logging.WARNING)


def test_a_refusal_does_not_fall_back_to_an_older_checkpoint(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path, CPU1, 3, _yaml())
    ckpts.resume(None, _parts())
    for step in (1, 2):
        ckpts.save(_parts(step), step)
    with pytest.raises(ConfigMismatch, match=r"step-00000002 was written with trainer\.seed=0"):
        Checkpoints(tmp_path, CPU1, 3, _yaml("trainer.seed=1")).resume("auto", _parts())
    assert [c.step for c in committed(tmp_path / "checkpoints")] == [1, 2]  # nothing moved


def test_applied_changes_are_said_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dpt")
    _written(tmp_path, _yaml("optimizer.lr=0.1", "trainer.max_steps=25"))
    ckpts = Checkpoints(tmp_path, CPU1, 3, _yaml("optimizer.lr=0.05", "trainer.max_steps=40"))
    start = ckpts.resume("auto", _parts())
    assert start is not None and [str(c) for c in start.changes] == [
        "optimizer.lr 0.1 -> 0.05",
        "trainer.max_steps 25 -> 40",
    ]
    assert (
        "resuming with changed settings: optimizer.lr 0.1 -> 0.05, trainer.max_steps 25 -> 40"
        in _messages(caplog)
    )


def test_another_run_folders_checkpoint_is_recognised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dpt")
    other = _written(tmp_path / "other", _yaml(), step=5)
    mine = tmp_path / "mine"
    _written(mine, _yaml(), step=3)  # this folder's own line, older than the other's step
    start = Checkpoints(mine, CPU1, 3, _yaml()).resume(str(other), _parts())
    assert start is not None and start.step == 5
    said = _messages(caplog)
    assert (
        f"starting from another run folder's checkpoint {other} (step 5); this run's "
        f"checkpoints go to {mine / 'checkpoints'}"
    ) in said
    assert committed(mine / "checkpoints") == []  # its own line moved aside, not mixed in
    assert any(m.startswith("moved 1 checkpoint(s) (step-00000003) aside") for m in said)


def test_a_checkpoint_of_an_abandoned_branch_is_this_runs_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dpt")
    ckpts = Checkpoints(tmp_path, CPU1, 5, _yaml())
    ckpts.resume(None, _parts())
    for step in (1, 2, 3):
        ckpts.save(_parts(step), step)
    Checkpoints(tmp_path, CPU1, 5, _yaml()).resume(str(tmp_path / "checkpoints" / "step-00000001"),
                                                   _parts())  # fmt: skip
    aside = next((tmp_path / "checkpoints").glob("abandoned-*")) / "step-00000003"
    caplog.clear()
    start = Checkpoints(tmp_path, CPU1, 5, _yaml()).resume(str(aside), _parts())
    assert start is not None and start.step == 3
    assert not any("another run folder" in m for m in _messages(caplog))
    assert [c.step for c in committed(tmp_path / "checkpoints")] == [1]  # older: kept in place


def test_another_run_folders_checkpoint_is_compared_too(tmp_path: Path) -> None:
    other = _written(tmp_path / "other", _yaml("model.hidden_dims=[8]"))
    with pytest.raises(ConfigMismatch, match=r"model\.hidden_dims=\[8\], this run has"):
        Checkpoints(tmp_path / "mine", CPU1, 3, _yaml()).resume(str(other), _parts())


# --- changed settings take effect ------------------------------------------------------------


def _resumed_trainer(run: Path, *overrides: str) -> Any:
    """A trainer built in `run` with `overrides`, resumed as a rank resumes (see
    dpt.loop.train)."""
    trainer = build_trainer(run, CPU1, *SMALL, *overrides)
    parts = trainer.parts
    configured = resume_apply.Settings.of(parts.optimizer, parts.scheduler)
    start = trainer.resume()
    assert start is not None
    resume_apply.apply(configured, parts.optimizer, parts.scheduler, start.changes)
    return trainer


def _lrs(trainer: Any) -> list[float]:
    return [g["lr"] for g in trainer.parts.optimizer.param_groups]


def test_a_new_learning_rate_takes_effect_after_the_optimizer_state_loads(tmp_path: Path) -> None:
    first = build_trainer(tmp_path, CPU1, *SMALL, "optimizer.lr=0.1", "trainer.max_steps=3")
    first.fit()
    trainer = _resumed_trainer(tmp_path, "optimizer.lr=0.05", "trainer.max_steps=6")
    assert _lrs(trainer) == [0.05]
    assert trainer.parts.optimizer.state  # the moments were loaded, not started afresh


def test_a_longer_run_stretches_the_loaded_schedule(tmp_path: Path) -> None:
    common = ["scheduler=warmup_cosine", "scheduler.warmup_steps=2", "scheduler.min_lr=0"]
    first = build_trainer(tmp_path, CPU1, *SMALL, *common, "trainer.max_steps=4")
    first.fit()
    resumed = _resumed_trainer(tmp_path, *common, "trainer.max_steps=8")
    fresh = build_trainer(tmp_path / "fresh", CPU1, *SMALL, *common, "trainer.max_steps=8")
    for _ in range(4):  # the same schedule, stepped to where the checkpoint is
        fresh.parts.optimizer.step()
        fresh.parts.scheduler.step()
    assert _lrs(resumed) == pytest.approx(_lrs(fresh), rel=1e-12)
    assert _lrs(resumed) != pytest.approx(_lrs(first))  # not the shorter schedule's end


def test_unchanged_settings_keep_the_loaded_state_as_it_was(tmp_path: Path) -> None:
    common = ["scheduler=step", "scheduler.step_size=1", "scheduler.gamma=0.5"]
    first = build_trainer(tmp_path, CPU1, *SMALL, *common, "trainer.max_steps=3")
    first.fit()
    resumed = _resumed_trainer(tmp_path, *common, "trainer.max_steps=3")
    assert _lrs(resumed) == _lrs(first)
    assert torch.equal(
        next(iter(resumed.parts.model.parameters())),
        next(iter(first.parts.model.parameters())),
    )
