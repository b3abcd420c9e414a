"""What the modules that act on a running loop (a resume's settings, the monitor's reactions) read
and change of it: the trainer, as they see it. A protocol, so that they need not import the
trainer, which calls them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from dpt.config.trainer import TrainerConfig
    from dpt.data.position import DataPosition
    from dpt.loop.agreement import Agreement
    from dpt.loop.parts import Parts
    from dpt.loop.precision import Precision
    from dpt.monitor.monitor import Monitor
    from dpt.observe.metrics import MetricsLogger
    from dpt.state.stateful import Progress, RNGState


class LoopState(Protocol):
    settings: TrainerConfig
    parts: Parts
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    metrics: MetricsLogger
    agreement: Agreement
    monitor: Monitor
    progress: Progress
    position: DataPosition
    rng: RNGState
    global_batch: int
    configured: Any  # resume_apply.Settings: as configured, before any checkpoint loaded

    def steps_left(self) -> int: ...

    def state_parts(self) -> dict[str, Any]: ...

    def save_checkpoint(self) -> Path | None: ...
