"""Models: built from the `model` config with sizes taken from the data set (the MLP, ResNets, any
torchvision classifier, a user's own), their blocks, weights files and synchronised BatchNorm.

May import: base.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpt.config.build import build_as
from dpt.contract import model_kwargs
from dpt.errors import DptError
from dpt.user_code import locate

# A key of every model's config that dpt applies itself (to any model with blocks), not the target.
RECOMPUTE_KEY = "activation_checkpointing"


def build_model(
    cfg: DictConfig, input_shape: tuple[int, ...], num_outputs: int, compiled: bool = False
) -> nn.Module:
    """The model as dpt.contract says: the config's keys, and those of `num_classes`,
    `num_outputs` (both: the outputs per sample the task needs) and `input_shape` that the
    target's signature names. `compiled`: it will run under torch.compile."""
    recompute = bool(cfg.get(RECOMPUTE_KEY, False))
    target = OmegaConf.create(
        {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != RECOMPUTE_KEY}
    )
    factory = locate(target._target_, "model._target_")
    model = build_as(target, "model", **model_kwargs(factory, input_shape, num_outputs))
    if not isinstance(model, nn.Module):
        raise DptError(
            f"model._target_={target._target_} built a {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    if recompute:
        from dpt.models.blocks import recompute_in_backward

        recompute_in_backward(model, compiled)
    return model


def _compiled_module_type() -> type | tuple[()]:
    """torch.compile's wrapper class, if torch.compile was ever used: importing torch._dynamo
    only to find that a model is not compiled would cost seconds."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame.OptimizedModule if eval_frame is not None else ()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, _compiled_module_type()):
            model = model._orig_mod
        else:
            return model
