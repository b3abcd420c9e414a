"""`task=regression`: float targets of any shape, the model giving as many numbers per sample
(reshaped to the target's); mse, l1 or huber; validation's MSE, MAE and R² (averaged over the
outputs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpt.tasks.task import Task, compared, float_targets, per_sample


class Regression(Task):
    def __init__(self, loss: str, huber_delta: float, **common: Any) -> None:
        super().__init__(**common)
        self.criterion = _loss(loss, huber_delta, "mean")
        self.per_element = _loss(loss, huber_delta, "none")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(*compared(outputs, targets))

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return per_sample(self.per_element(*compared(outputs, targets)))

    def metrics(self) -> dict[str, Any]:
        from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, R2Score

        return self.named(MeanSquaredError(), MeanAbsoluteError(), R2Score())

    def update(self, metrics: Any, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        # (B, n) rows, or (B,) for one output: R² per output, then their mean.
        rows = self.predict(outputs)
        truth = float_targets(outputs, targets).reshape(rows.shape)
        if rows.shape[1] == 1:
            rows, truth = rows[:, 0], truth[:, 0]
        for metric in metrics.values():
            metric.update(rows, truth)


def _loss(name: str, delta: float, reduction: str) -> nn.Module:
    if name == "huber":
        return nn.HuberLoss(reduction=reduction, delta=delta)
    return {"mse": nn.MSELoss, "l1": nn.L1Loss}[name](reduction=reduction)
