"""Changed optimizer and schedule settings take effect after a resume.

Loading a checkpoint restores the optimizer's param groups (lr, betas, ...) and the scheduler's
attributes (base lrs, warmup and total steps, step size) as they were written: a new
`optimizer.lr` or `trainer.max_steps` would be silently ignored. `Settings` is taken from the
freshly built optimizer and scheduler before the load and put back afterwards, with the loaded
progress (steps done) kept and the current learning rate recomputed for that progress.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from dpt.resume_config import Change

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
    for group, lr in zip(optimizer.param_groups, current_lrs(settings, scheduler), strict=True):
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
