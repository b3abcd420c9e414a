"""`optimizer` and `scheduler`: torch's optimizers (and dpt's AdamW for GPTs), dpt's schedules
(dpt/loop/optimizers.py, schedulers.py), each built as a partial the run completes."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from dpt.config.checks import Check, at_least, checked

# Keys of every optimizer's config that dpt applies itself (the parameter groups it hands the
# optimizer: dpt/loop/param_groups.py), not passed to `_target_`.
GROUP_KEYS = ("groups", "layer_decay")
# Adam's and AdamW's key for torch's fused kernel, which dpt gives only where the parameters
# allow it (dpt.loop.optimizers.fused_fits).
FUSED_KEY = "fused"


@dataclass
class ParamGroupConfig:
    """Parameters whose name matches `match` (fnmatch, of the parameter or a module above it):
    their learning rate times `lr_scale`, their own weight decay where given."""

    match: str = MISSING
    lr_scale: float = at_least(0, 1.0)
    weight_decay: float | None = at_least(0, None, null="the optimizer's")


@dataclass
class ParamGroups:
    """What every optimizer's config has: its groups of parameters (the first match wins; the
    rest train at optimizer.lr), and timm's layer-wise decay."""

    groups: list[ParamGroupConfig] = field(default_factory=list)
    # A model with blocks: block i of n trains at lr x layer_decay^(n - i), the embeddings
    # before them at layer_decay^(n + 1), the head after them at lr; null: off.
    layer_decay: float | None = checked(Check(lambda v: 0 < v <= 1, "must be > 0 and <= 1"), None)


@dataclass
class AdamConfig(ParamGroups):
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = at_least(0)
    weight_decay: float = at_least(0)
    betas: list[float] = MISSING
    # torch's fused kernel (one call for all the parameters: Hugging Face's Trainer's default)
    # where the parameters' device has it; false: torch's default (a loop per tensor on the CPU)
    fused: bool = MISSING


@dataclass
class AdamWConfig(ParamGroups):
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = at_least(0)
    weight_decay: float = at_least(0)
    betas: list[float] = MISSING
    fused: bool = MISSING  # as AdamConfig's


@dataclass
class AdamWGPTConfig(AdamWConfig):
    """AdamW with weight decay on matrices only (dpt/loop/optimizers.py)."""

    _target_: str = "dpt.loop.optimizers.adamw_gpt"


@dataclass
class SGDConfig(ParamGroups):
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
