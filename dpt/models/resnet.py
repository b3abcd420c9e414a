"""torchvision ResNets with the head sized to the dataset; weights only from a local file."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn

from dpt.config.models import RESNET_ARCHS
from dpt.errors import DptError
from dpt.models.weights import load_weights

ARCHS = RESNET_ARCHS


def resnet(
    input_shape: tuple[int, ...],
    num_classes: int,
    arch: str,
    weights: str | None,
    channels_last: bool,
) -> nn.Module:
    if len(input_shape) != 3:
        raise DptError(
            f"model={arch} takes images (C, H, W), but the dataset gives inputs of shape "
            f"{tuple(input_shape)} (use model=mlp for vectors)"
        )
    # `validate` checks this before any process starts; a builder called directly checks too.
    if arch not in ARCHS:
        raise DptError(f"model.arch={arch}: must be one of {', '.join(ARCHS)}")
    model: nn.Module = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if weights:
        load_weights(model, Path(weights), arch, num_classes)
    if channels_last:
        # NHWC lets cuDNN use tensor-core convolutions without layout transposes.
        model = model.to(memory_format=torch.channels_last)
    return model
