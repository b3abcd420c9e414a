"""Learning-rate schedules, stepped once per optimizer step.

Each builder takes the optimizer and the run's total number of optimizer steps, so a schedule can
be stated in steps (warmup) and fractions of the run (cosine to the end).
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

log = logging.getLogger("dpt")


def constant(optimizer: Optimizer, total_steps: int) -> LRScheduler:
    return LambdaLR(optimizer, _Constant())


def step(
    optimizer: Optimizer, total_steps: int, step_size: int = 1000, gamma: float = 0.1
) -> LRScheduler:
    """Multiply the learning rate by `gamma` every `step_size` optimizer steps."""
    return StepLR(optimizer, step_size=step_size, gamma=gamma)


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 100, min_lr: float = 0.0
) -> LRScheduler:
    """Linear warmup from 0 to the optimizer's lr over `warmup_steps`, then a cosine down to
    `min_lr` at the last step."""
    if warmup_steps >= total_steps:  # a silent constant-ish schedule is worse than a word
        log.warning(
            f"scheduler.warmup_steps={warmup_steps}: the run has only {total_steps} optimizer "
            "steps, so the learning rate never leaves the warmup (no cosine decay)"
        )
    base_lr = optimizer.param_groups[0]["lr"]
    floor = min_lr / base_lr if base_lr else 0.0
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, floor))


class _Constant:
    # Callable objects, not lambdas: LambdaLR saves their __dict__ (plain numbers) in checkpoints.
    def __call__(self, step: int) -> float:
        return 1.0


class WarmupCosine:
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
