"""A user's own model, data set and loss, as `model._target_`, `dataset=custom` and `task=custom`
name them (tests/test_predict.py trains a run of every task with them)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class SimpleNet(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, output_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class RandomVectors(Dataset):
    """Random vectors (`input_dim`) and a float target of `outputs` numbers per sample: `binary`
    0/1 columns (the sum's sign, then the first coordinates' signs), `multilabel` a K-hot row of
    the first coordinates' signs, `regression` values (an affine map of the first coordinates)."""

    def __init__(
        self, n_samples: int, input_dim: int, target: str, outputs: int, seed: int
    ) -> None:
        generator = torch.Generator().manual_seed(seed * 1000 + n_samples)
        self.x = torch.randn(n_samples, input_dim, generator=generator)
        first = self.x[:, :outputs]
        if target == "binary":
            self.y = torch.cat([self.x.sum(dim=1, keepdim=True), first[:, 1:]], dim=1) > 0
        elif target == "multilabel":
            self.y = first > 0
        else:
            self.y = 2 * first + 1
        self.y = self.y.float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def focal_loss(outputs: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Binary focal loss on logits: cross-entropy weighted by (1 - p_t) ** gamma."""
    entropy = nn.functional.binary_cross_entropy_with_logits(outputs, targets, reduction="none")
    p = torch.sigmoid(outputs)
    p_t = p * targets + (1 - p) * (1 - targets)
    return ((1 - p_t) ** gamma * entropy).mean()
