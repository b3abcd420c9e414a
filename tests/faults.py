"""Test-only models that fail on purpose, selected with `model._target_=tests.faults...`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

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


class KilledOnceMLP(MLP):
    """SIGKILLs its own process on rank $DPT_TEST_KILL_RANK at training forward call
    $DPT_TEST_KILL_CALL, once: the first time, it leaves the file $DPT_TEST_KILL_MARKER (a rank
    restarted with the run does not die again). A worker lost as a node or a preemption loses
    one, with no chance to say anything."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        _kill_once(self)
        return super().forward(inputs)


def _kill_once(model: torch.nn.Module) -> None:
    model.calls = getattr(model, "calls", 0) + int(model.training)
    marker = Path(os.environ["DPT_TEST_KILL_MARKER"])
    if (
        model.training
        and os.environ.get("RANK", "0") == os.environ["DPT_TEST_KILL_RANK"]
        and model.calls == int(os.environ["DPT_TEST_KILL_CALL"])
        and not marker.exists()
    ):
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def kill_once_in(cls: type[MLP]) -> None:
    """`cls` (dpt's MLP itself, where a documented command names no test model) dies as
    KilledOnceMLP does (tests/ray_site/sitecustomize.py)."""
    forward = cls.forward

    def killed_once(self: MLP, inputs: torch.Tensor) -> torch.Tensor:
        _kill_once(self)
        return forward(self, inputs)

    cls.forward = killed_once  # type: ignore[method-assign]
