"""`optimizer` and `scheduler`: torch's optimizers (and dpt's AdamW for GPTs), dpt's schedules
(dpt/loop/optimizers.py, schedulers.py), each built as a partial the run completes."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from dpt.config.checks import at_least


@dataclass
class AdamConfig:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = at_least(0)
    weight_decay: float = at_least(0)
    betas: list[float] = MISSING


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = at_least(0)
    weight_decay: float = at_least(0)
    betas: list[float] = MISSING


@dataclass
class AdamWGPTConfig(AdamWConfig):
    """AdamW with weight decay on matrices only (dpt/loop/optimizers.py)."""

    _target_: str = "dpt.loop.optimizers.adamw_gpt"


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = at_least(0)
    momentum: float = at_least(0)
    weight_decay: float = at_least(0)
    nesterov: bool = MISSING


@dataclass
class ConstantScheduleConfig:
    _target_: str = "dpt.loop.schedulers.constant"
    _partial_: bool = True


@dataclass
class WarmupCosineConfig:
    _target_: str = "dpt.loop.schedulers.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = at_least(0)
    min_lr: float = at_least(0)


@dataclass
class StepScheduleConfig:
    _target_: str = "dpt.loop.schedulers.step"
    _partial_: bool = True
    step_size: int = at_least(1)
    gamma: float = at_least(0)


OPTIMIZERS: dict[str, type] = {
    "adam": AdamConfig,
    "adamw": AdamWConfig,
    "adamw_gpt": AdamWGPTConfig,
    "sgd": SGDConfig,
}
SCHEDULERS: dict[str, type] = {
    "constant": ConstantScheduleConfig,
    "warmup_cosine": WarmupCosineConfig,
    "step": StepScheduleConfig,
}
