"""Learning-rate schedules, stepped once per optimizer step.

Each builder takes the optimizer and the run's total number of optimizer steps, so a schedule can
be stated in steps (warmup) and fractions of the run (cosine to the end).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from dpt.loggers import ONCE_LOGGER_NAME

once = logging.getLogger(ONCE_LOGGER_NAME)  # every rank builds the schedule: rank 0 says it


def constant(optimizer: Optimizer, total_steps: int) -> Constant:
    return Constant(optimizer)


class Constant:
    """The optimizer's own learning rate, unchanged. Not an LRScheduler on purpose: those wrap
    `optimizer.step` with a call counter and recompute every group's lr each step, which a loop
    without a schedule, as one writes it by hand, does not pay."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_epoch = int(state["last_epoch"])


def step(optimizer: Optimizer, total_steps: int, step_size: int, gamma: float) -> LRScheduler:
    """Multiply the learning rate by `gamma` every `step_size` optimizer steps."""
    return StepLR(optimizer, step_size=step_size, gamma=gamma)


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int, min_lr: float
) -> LRScheduler:
    """Linear warmup from 0 to the optimizer's lr over `warmup_steps`, then a cosine down to
    `min_lr` at the last step."""
    if warmup_steps >= total_steps:  # a silent constant-ish schedule is worse than a word
        once.warning(
            f"scheduler.warmup_steps={warmup_steps}: the run has only {total_steps} optimizer "
            "steps, so the learning rate never leaves the warmup (no cosine decay)"
        )
    base_lr = optimizer.param_groups[0]["lr"]
    floor = min_lr / base_lr if base_lr else 0.0
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, floor))


class WarmupCosine:
    # A callable object, not a lambda: LambdaLR saves its __dict__ (plain numbers) in checkpoints.
    def __init__(self, warmup_steps: int, total_steps: int, floor: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.floor = floor

    def __call__(self, step: int) -> float:
        """Factor on the base lr for the update after `step` completed steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def replan(scheduler: Any, total_steps: int) -> bool:
    """A resumed run whose total changed under it (another global batch): a schedule stated in
    fractions of the run (warmup_cosine) ends at the new last step. Returns whether the
    schedule depends on the run's length (constant and step schedules do not)."""
    stretched = [f for f in getattr(scheduler, "lr_lambdas", []) if isinstance(f, WarmupCosine)]
    for f in stretched:
        f.total_steps = total_steps
    return bool(stretched)
