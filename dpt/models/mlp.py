"""A small fully connected classifier."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dpt.errors import DptError


class MLP(nn.Sequential):
    """Linear -> ReLU blocks of `hidden_dims` widths, then a linear head."""

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, hidden_dims: Sequence[int]
    ) -> None:
        if len(input_shape) != 1:
            raise DptError(
                f"model=mlp takes vectors, but the dataset gives inputs of shape "
                f"{tuple(input_shape)}"
                " (use an image model such as model=resnet18)"
            )
        layers: list[nn.Module] = []
        width = input_shape[0]
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
