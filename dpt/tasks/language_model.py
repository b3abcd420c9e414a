"""`task=language_model`: next-token prediction. The model gives logits (B, T, V) for token ids
(B, T); the target is the same window one token later (B, T). Cross-entropy over the scored
positions (every one, but those whose target is IGNORE_INDEX: dataset=chat's outside the
answers); validation's loss and perplexity per scored token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpt.targets import IGNORE_INDEX
from dpt.tasks.task import Task


class LanguageModel(Task):
    loss_on_split_logits = True

    def __init__(self, **common: Any) -> None:
        super().__init__(**common)
        self.criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self.per_token = nn.CrossEntropyLoss(reduction="none", ignore_index=IGNORE_INDEX)

    @property
    def tokens_per_sample(self) -> int:
        """Positions a sample trains: its window's length (train/tokens_per_s)."""
        return self.targets.shape[0]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs.flatten(0, 1), targets.flatten())

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each sample's mean over its scored positions (0 where it has none)."""
        losses = self.per_token(outputs.flatten(0, 1), targets.flatten()).view(targets.shape)
        return losses.sum(dim=1) / self.sample_weights(targets).clamp(min=1)

    def sample_weights(self, targets: torch.Tensor) -> torch.Tensor:
        """Its scored positions: validation's loss is then the mean per scored token."""
        return (targets != IGNORE_INDEX).sum(dim=1).float()

    def metrics(self) -> dict[str, Any]:
        from torchmetrics.text import Perplexity

        return self.named(Perplexity(ignore_index=IGNORE_INDEX))

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """The next token's probabilities after each sequence (its last position)."""
        return torch.softmax(outputs[:, -1].float(), dim=-1)
