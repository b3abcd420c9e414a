"""torchvision ResNets with the head sized to the dataset; weights only from a local file."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn

from dpt.errors import DptError

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


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
    if arch not in ARCHS:
        raise DptError(f"model.arch={arch}: must be one of {', '.join(ARCHS)}")
    model: nn.Module = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if weights:
        load_weights(model, Path(weights), arch)
    if channels_last:
        # NHWC lets cuDNN use tensor-core convolutions without layout transposes.
        model = model.to(memory_format=torch.channels_last)
    return model


def load_weights(model: nn.Module, path: Path, arch: str) -> None:
    """Load a local state_dict (never downloaded, never unpickled beyond tensors). A head of
    another size (e.g. ImageNet's 1000 classes) is left freshly initialised."""
    if not path.is_file():
        raise DptError(f"model.weights={path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise DptError(f"model.weights={path}: not a loadable state_dict ({error})") from error
    state = state.get("model", state) if isinstance(state, dict) else state
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    missing = [k for k in own if k not in usable and not k.startswith("fc.")]
    if missing:
        raise DptError(
            f"model.weights={path}: does not fit model={arch} ({len(missing)} tensors missing or "
            f"of another shape, e.g. {missing[0]})"
        )
    model.load_state_dict(usable, strict=False)
