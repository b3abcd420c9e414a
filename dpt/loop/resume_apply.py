"""Changed settings take effect after a resume: the optimizer's and the schedule's, the global
batch (the epoch continues from the same sample), the world size (the RNG streams).

Loading a checkpoint restores the optimizer's param groups (lr, betas, ...) and the scheduler's
attributes (base lrs, warmup and total steps, step size) as they were written: a new
`optimizer.lr` or `trainer.max_steps` would be silently ignored. `Settings` is taken from the
freshly built optimizer and scheduler before the load and put back afterwards, with the loaded
progress (steps done) kept and the current learning rate recomputed for that progress.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from dpt.loop import schedulers
from dpt.seeding import derived_seed, seed_everything
from dpt.state.resume_config import Change

if TYPE_CHECKING:
    from dpt.loop.loop_state import LoopState

log = logging.getLogger("dpt")

# What a schedule has done so far, as opposed to how it is set (torch's LRScheduler attributes).
PROGRESS = ("last_epoch", "_step_count", "_get_lr_called_within_step", "_is_initial", "_last_lr")
# Changes that alter the schedule: its settings, the base lr, the run's length.
SCHEDULE_KEYS = ("optimizer.lr", "trainer.max_steps", "trainer.epochs", "trainer.batch_size",
                 "trainer.grad_accum_steps", "launcher.", "strategy.", "scheduler.")  # fmt: skip


@dataclass(frozen=True)
class Settings:
    groups: list[dict[str, Any]]  # each param group without its params
    schedule: dict[str, Any]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, scheduler: Any) -> Settings:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(copy.deepcopy(groups), copy.deepcopy(scheduler.state_dict()))


def apply(
    settings: Settings, optimizer: torch.optim.Optimizer, scheduler: Any, changes: Iterable[Change]
) -> None:
    """Put the config's settings back over the loaded ones, for the keys that changed."""
    keys = [c.key for c in changes]
    names = {k.removeprefix("optimizer.") for k in keys if k.startswith("optimizer.")}
    for group, fresh in zip(optimizer.param_groups, settings.groups, strict=True):
        for name in names - {"lr"}:
            if name in fresh:
                group[name] = fresh[name]
    if any(k.startswith(SCHEDULE_KEYS) for k in keys):
        _reschedule(settings, optimizer, scheduler)


def _reschedule(settings: Settings, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    loaded = scheduler.state_dict()
    scheduler.load_state_dict({**settings.schedule,
                               **{k: loaded[k] for k in PROGRESS if k in loaded}})  # fmt: skip
    for group, fresh in zip(optimizer.param_groups, settings.groups, strict=True):
        if "initial_lr" in fresh:
            group["initial_lr"] = fresh["initial_lr"]
    _set_lrs(optimizer, scheduler, current_lrs(settings, scheduler))


def _set_lrs(optimizer: torch.optim.Optimizer, scheduler: Any, lrs: list[float]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def current_lrs(settings: Settings, scheduler: Any) -> list[float]:
    """The learning rate each group has after the loaded steps, under the config's schedule."""
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)  # StepLR and most others
    if closed_form is not None:
        return list(closed_form())
    if isinstance(scheduler, LambdaLR):
        step, lambdas = scheduler.last_epoch, scheduler.lr_lambdas
        return [base * f(step) for base, f in zip(scheduler.base_lrs, lambdas, strict=True)]
    return [group["lr"] for group in settings.groups]  # a constant lr: the configured one


def after_load(trainer: LoopState, changes: Iterable[Change]) -> None:
    """What a loaded checkpoint needs to continue under this run's config (a resume, a
    rollback): its changed settings, its global batch and world size."""
    apply(trainer.configured, trainer.optimizer, trainer.scheduler, changes)
    continue_data(trainer)  # another global batch: from the same sample
    rederive_rng(trainer)  # another world size: the RNG streams


def continue_data(trainer: LoopState) -> None:
    """Another global batch continues the epoch from the sample the checkpoint stopped at (the
    same global batch on another world size takes exactly the uninterrupted run's samples)."""
    position, was = trainer.position, trainer.position.global_batch
    if was == trainer.global_batch:
        return
    position.global_batch = trainer.global_batch
    _replan(trainer)
    if trainer.parts.env.is_main:
        log.info(
            f"resuming at sample {position.sample} of epoch {position.epoch + 1} with global "
            f"batch {trainer.global_batch} (was {was}): the epoch continues from the same "
            f"sample, {trainer.steps_left()} full step(s) left in it"
        )


def replan(trainer: LoopState) -> None:
    """The run's total steps anew, where the steps done no longer add up to the plan (a global
    batch changed on resume, a rollback skipped batches of an epoch)."""
    if _planned_total(trainer) != trainer.parts.total_steps:
        _replan(trainer)


def _planned_total(trainer: LoopState) -> int:
    """trainer.max_steps where set, else the steps done plus what the rest of the epochs give."""
    t, parts = trainer.settings, trainer.parts
    later_epochs = max(0, t.epochs - trainer.position.epoch - 1)
    per_epoch = parts.loaders.steps_per_epoch(t.grad_accum_steps)
    return t.max_steps or trainer.progress.step + trainer.steps_left() + later_epochs * per_epoch


def _replan(trainer: LoopState) -> None:
    """The steps done were of the old global batch (or fewer than planned): the run's total is
    trainer.max_steps where set, else those plus what the rest of its epochs give at the new
    one."""
    parts = trainer.parts
    parts.total_steps = _planned_total(trainer)
    parts.agreement.last_step = parts.total_steps
    parts.metrics.replan(parts.total_steps)
    if schedulers.replan(parts.scheduler, parts.total_steps):  # the lr at the steps done, anew
        configured = Settings.of(parts.optimizer, parts.scheduler)
        _set_lrs(parts.optimizer, parts.scheduler, current_lrs(configured, parts.scheduler))


def rederive_rng(trainer: LoopState) -> None:
    """A checkpoint of another world size holds other ranks' generators: every rank seeds
    its own from (seed, rank, step) instead. Data order and augmentation do not use them."""
    stored, trainer.rng.stored_world = trainer.rng.stored_world, None  # saves store this rank's
    env = trainer.parts.env
    if stored is None or stored == env.world_size:
        return
    seed_everything(derived_seed(trainer.settings.seed, env.rank, trainer.progress.step))
    if env.is_main:
        log.info(
            f"the checkpoint holds random generators for {stored} rank(s), this run has "
            f"{env.world_size}: every rank's are re-derived from (trainer.seed, rank, step "
            f"{trainer.progress.step}); data order and augmentation do not depend on them"
        )
