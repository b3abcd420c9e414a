"""`task=classification`: one class per sample, cross-entropy on the logits (B, K) against
integer labels (B,); validation's top-1 and (with 5 classes or more) top-5 accuracy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpt.tasks.task import Task


class Classification(Task):
    def __init__(self, label_smoothing: float, **common: Any) -> None:
        super().__init__(**common)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # val/loss is the plain cross-entropy: comparable across label_smoothing settings.
        self.per_sample = nn.CrossEntropyLoss(reduction="none")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs, targets)

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.per_sample(outputs, targets)

    def metrics(self) -> dict[str, Any]:
        from torchmetrics.classification import MulticlassAccuracy

        tops = (1, 5) if self.num_outputs >= 5 else (1,)  # acc1, and acc5 with 5 classes or more
        return self.named(*(MulticlassAccuracy(num_classes=self.num_outputs, top_k=k,
                                               average="micro") for k in tops))  # fmt: skip

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """Class probabilities, each row summing to 1."""
        return torch.softmax(outputs.float(), dim=1)
