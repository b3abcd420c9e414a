"""`task=language_model`: next-token prediction. The model gives logits (B, T, V) for token ids
(B, T); the target is the same window one token later (B, T). Cross-entropy over every
position; validation's loss and perplexity (exp of the mean cross-entropy per token)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpt.tasks.task import Task


class LanguageModel(Task):
    def __init__(self, **common: Any) -> None:
        super().__init__(**common)
        self.criterion = nn.CrossEntropyLoss()
        self.per_token = nn.CrossEntropyLoss(reduction="none")

    @property
    def tokens_per_sample(self) -> int:
        """Positions a sample trains: its window's length (train/tokens_per_s)."""
        return self.targets.shape[0]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs.flatten(0, 1), targets.flatten())

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = self.per_token(outputs.flatten(0, 1), targets.flatten())
        return losses.view(targets.shape).mean(dim=1)  # every sample has T positions

    def metrics(self) -> dict[str, Any]:
        from torchmetrics.text import Perplexity

        return self.named(Perplexity())

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """The next token's probabilities after each sequence (its last position)."""
        return torch.softmax(outputs[:, -1].float(), dim=-1)
