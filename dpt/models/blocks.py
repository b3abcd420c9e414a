"""A model's blocks: the units that fsdp shards one by one and activation checkpointing recomputes.

The MLP's blocks are its linear layers, a ResNet's its residual blocks (each stage's children),
and other torchvision classifiers' their repeated blocks (`TORCHVISION_BLOCKS`: inverted
residuals, MBConvs, ConvNeXt and transformer blocks). Found the same way before and after
activation checkpointing wraps them, so fsdp shards the wrapped blocks (the order PyTorch's FSDP2
expects: recomputation inside the sharded unit).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dpt.errors import DptError
from dpt.models.gpt import GPT
from dpt.models.hf import block_class_names, is_transformers_model
from dpt.models.mlp import MLP

RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")
# torchvision's repeated blocks, (module, class): each maps a tensor to a new tensor (not a
# view, which FSDP2 warns about: ShuffleNet's blocks end in a channel shuffle view), holds its own
# parameters and is registered in forward order. Named, not imported: no torchvision import to
# find out that a model has none.
TORCHVISION_BLOCKS = frozenset(
    {
        ("torchvision.models.mobilenetv2", "InvertedResidual"),
        ("torchvision.models.mobilenetv3", "InvertedResidual"),
        ("torchvision.models.efficientnet", "MBConv"),
        ("torchvision.models.efficientnet", "FusedMBConv"),
        ("torchvision.models.convnext", "CNBlock"),
        ("torchvision.models.regnet", "ResBottleneckBlock"),
        ("torchvision.models.mnasnet", "_InvertedResidual"),
        ("torchvision.models.swin_transformer", "SwinTransformerBlock"),
        ("torchvision.models.swin_transformer", "SwinTransformerBlockV2"),
        ("torchvision.models.vision_transformer", "EncoderBlock"),
    }
)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in forward order; [] for a model dpt knows no blocks of. A pipeline
    stage's copy of the model holds only its own (the others are None: dpt.models.stages)."""
    return [block for block in _blocks(model) if block is not None]


def _blocks(model: nn.Module) -> list[nn.Module | None]:
    if isinstance(model, MLP):
        return [layer for layer in model
                if layer is not None and any(True for _ in layer.parameters())]  # fmt: skip
    if isinstance(model, GPT):
        return list(model.h)  # as the model holds them (wrapped, once recomputed)
    if _is_resnet(model):
        return [block for stage in RESNET_STAGES for block in getattr(model, stage)]
    if is_transformers_model(model):
        names = block_class_names(model)
        return list(_outermost(model, lambda c: c.__name__ in names))
    return list(_outermost(model, lambda c: (c.__module__, c.__name__) in TORCHVISION_BLOCKS))


def _outermost(module: nn.Module, is_block: Callable[[type], bool]) -> Iterator[nn.Module]:
    """The outermost blocks under `module` (a class or one of its bases `is_block`), each as
    the model holds it (inside activation checkpointing's wrapper: the wrapper). The bases
    too: FSDP2 subclasses a module's class when it shards it."""
    for child in module.children():
        inner = getattr(child, "_checkpoint_wrapped_module", child)
        if any(is_block(c) for c in type(inner).__mro__):
            yield child
        else:
            yield from _outermost(child, is_block)


def _is_resnet(model: nn.Module) -> bool:
    # torchvision is imported only where a ResNet was built: no import to find out it is not one.
    resnet = sys.modules.get("torchvision.models.resnet")
    return resnet is not None and isinstance(model, resnet.ResNet)


def recompute_in_backward(model: nn.Module, compiled: bool = False) -> None:
    """Wrap each block in place: its activations are dropped after forward and recomputed in
    backward (`torch.utils.checkpoint` without reentrance). State-dict keys stay the same: the
    wrapper's hooks remove its own prefix, so checkpoints load with and without it. `compiled`:
    the model will run under torch.compile, whose recomputation replays no buffer updates and
    which refuses the contexts that keep them in eager mode."""
    targets = set(blocks(model))
    if not targets:
        raise DptError(
            f"model.activation_checkpointing=true: dpt knows no blocks of {type(model).__name__} "
            "(it knows the MLP's layers, the ResNets' residual blocks, the blocks of torchvision's "
            "MobileNets, EfficientNets, ConvNeXts, RegNets, MNASNets, Swins and ViTs, and a "
            "transformers model's _no_split_modules)"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    wrap = functools.partial(_recomputed, keep_buffers=not compiled)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=targets.__contains__)


def _recomputed(block: nn.Module, keep_buffers: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    # Only eager blocks with buffers (BatchNorm's statistics) need the contexts.
    keep = keep_buffers and next(block.buffers(), None) is not None
    contexts = {"context_fn": functools.partial(_contexts, block)} if keep else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **contexts)


def _contexts(block: nn.Module) -> tuple[Any, Any]:
    """(forward, recomputation) contexts: the recomputation must not count as a second batch
    for BatchNorm's running statistics, which a training-mode forward updates."""
    return contextlib.nullcontext(), _buffers_kept(block)


@contextlib.contextmanager
def _buffers_kept(block: nn.Module) -> Iterator[None]:
    kept = [(buffer, buffer.clone()) for buffer in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)
