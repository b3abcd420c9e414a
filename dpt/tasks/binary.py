"""`task=binary`: yes/no per target column. One logit per column, binary cross-entropy on the
logits against 0/1 targets; validation's accuracy and F1 at `task.threshold`, and AUROC, over
every (sample, column)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpt.tasks.task import Task, compared, per_sample


class Logits(Task):
    """Independent yes/no logits (binary and multilabel): BCEWithLogitsLoss, `pos_weight`."""

    def __init__(self, pos_weight: Any, threshold: float, **common: Any) -> None:
        super().__init__(**common)
        weight = None if pos_weight is None else torch.as_tensor(pos_weight, dtype=torch.float32)
        self.criterion = nn.BCEWithLogitsLoss(pos_weight=weight)
        self.per_element = nn.BCEWithLogitsLoss(reduction="none", pos_weight=weight)
        self.threshold = threshold

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(*compared(outputs, targets))

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return per_sample(self.per_element(*compared(outputs, targets)))

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """The probability of each column or label."""
        return torch.sigmoid(outputs.reshape(len(outputs), -1).float())

    def pairs(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities (B, n) and 0/1 targets (B, n), as torchmetrics takes them (given as
        probabilities: it would read logits that happen to lie in [0, 1] as probabilities)."""
        rows = targets.reshape(len(targets), -1)
        return self.predict(outputs), (rows > 0.5).long()


class Binary(Logits):
    def metrics(self) -> dict[str, Any]:
        from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryF1Score

        return self.named(BinaryAccuracy(threshold=self.threshold), BinaryAUROC(),
                          BinaryF1Score(threshold=self.threshold))  # fmt: skip

    def update(self, metrics: Any, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        probabilities, truth = self.pairs(outputs, targets)
        for metric in metrics.values():  # every (sample, column) a yes/no of its own
            metric.update(probabilities.flatten(), truth.flatten())
