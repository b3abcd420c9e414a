"""Models: built from the `model` config with sizes taken from the data set (the MLP, ResNets, any
torchvision classifier, a user's own), their blocks, weights files and synchronised BatchNorm.

May import: base.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpt.config.build import build_as
from dpt.config.models import INIT_KEY
from dpt.contract import model_kwargs
from dpt.errors import DptError
from dpt.user_code import locate

# A key of every model's config that dpt applies itself (to any model with blocks), not the target.
RECOMPUTE_KEY = "activation_checkpointing"


def build_model(
    cfg: DictConfig,
    input_shape: tuple[int, ...],
    num_outputs: int,
    compiled: bool = False,
    task: str | None = None,
) -> nn.Module:
    """The model as dpt.contract says: the config's keys, and those of `num_classes`,
    `num_outputs` (both: the outputs per sample the task needs), `input_shape` and `task` (its
    kind) that the target's signature names, with fresh weights. `compiled`: it will run under
    torch.compile."""
    values = OmegaConf.to_container(cfg, resolve=True)
    recompute = bool(values.pop(RECOMPUTE_KEY, False))
    values.pop(INIT_KEY, None)  # the loop loads them: dpt.loop.parts.initial_weights
    target = OmegaConf.create(values)
    factory = locate(target._target_, "model._target_")
    model = build_as(target, "model", **model_kwargs(factory, input_shape, num_outputs, task))
    if not isinstance(model, nn.Module):
        raise DptError(
            f"model._target_={target._target_} built a {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    if recompute:
        from dpt.models.blocks import recompute_in_backward

        recompute_in_backward(model, compiled)
    return model


def token_flops(model: nn.Module) -> Callable[[int], float] | None:
    """The model's training FLOPs per token of a sequence of so many tokens, where its family
    counts them (dpt's GPT; a transformers model, from its config)."""
    from dpt.models.families import family_of

    return family_of(model).flops_per_token(model)


def _compiled_module_type() -> type | tuple[()]:
    """torch.compile's wrapper class, if torch.compile was ever used: importing torch._dynamo
    only to find that a model is not compiled would cost seconds."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame.OptimizedModule if eval_frame is not None else ()


# Wrappers' parts of a module's name (activation checkpointing, fsdp 1, torch.compile): left out
# of the bare model's names, as state dicts and weight files name its tensors.
WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def bare_name(name: str) -> str:
    """A wrapped module's or tensor's name as the bare model has it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, _compiled_module_type()):
            model = model._orig_mod
        else:
            return model
