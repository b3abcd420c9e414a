"""Test-only models that fail on purpose, selected with `model._target_=tests.faults...`."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from dpt.models.mlp import MLP


class RaisingMLP(MLP):
    """Raises on rank $DPT_TEST_FAIL_RANK at forward call $DPT_TEST_FAIL_CALL."""

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, hidden_dims: Sequence[int]
    ) -> None:
        super().__init__(input_shape, num_classes, hidden_dims)
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rank = os.environ.get("RANK", "0")
        if (
            self.training
            and rank == os.environ["DPT_TEST_FAIL_RANK"]
            and (self.calls == int(os.environ["DPT_TEST_FAIL_CALL"]))
        ):
            raise ValueError(f"injected failure on rank {rank} at call {self.calls}")
        return super().forward(inputs)


class SlowMLP(MLP):
    """Sleeps $DPT_TEST_SLOW_S seconds in every training forward on rank $DPT_TEST_SLOW_RANK:
    a straggler."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK", "0") == os.environ["DPT_TEST_SLOW_RANK"]:
            time.sleep(float(os.environ["DPT_TEST_SLOW_S"]))
        return super().forward(inputs)


class MismatchedMLP(torch.nn.Module):
    """A user's model whose first layer does not fit the data: it takes 7 inputs, whatever the
    data set gives (takes `hidden_dims`, as a model under model=mlp's schema must)."""

    def __init__(self, num_classes: int, hidden_dims: Sequence[int]) -> None:
        super().__init__()
        width = hidden_dims[0]
        self.net = torch.nn.Sequential(
            torch.nn.Linear(7, width), torch.nn.ReLU(), torch.nn.Linear(width, num_classes)
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)
