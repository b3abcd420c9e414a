"""A model's blocks: the units that fsdp shards one by one and activation checkpointing recomputes.

Each family says what its blocks are (dpt/models/families): the MLP's linear layers, a ResNet's
residual blocks, the GPT's and a transformers model's decoder layers, torchvision's repeated
blocks. Found the same way before and after activation checkpointing wraps them, so fsdp shards
the wrapped blocks (the order PyTorch's FSDP2 expects: recomputation inside the sharded unit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dpt.errors import DptError
from dpt.models.families import family_of


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in forward order; [] for a model dpt knows no blocks of. A pipeline
    stage's copy of the model holds only its own (the others are None: dpt.models.stages)."""
    return [block for block in family_of(model).blocks(model) if block is not None]


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
