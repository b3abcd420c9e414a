"""A model with a module that divides by an input feature: a sample whose first feature is 0
makes its output infinite (tests/monitor_data/poisoned.py's `poison: zero`)."""

from __future__ import annotations

import torch
from torch import nn


class Ratio(nn.Module):
    """Every feature divided by the first one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x[:, :1]


class DividingNet(nn.Module):
    def __init__(self, num_classes: int, input_shape: tuple[int, ...], hidden: int) -> None:
        super().__init__()
        self.ratio = Ratio()
        self.body = nn.Sequential(nn.Linear(input_shape[0], hidden), nn.Tanh())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.ratio(x)))
