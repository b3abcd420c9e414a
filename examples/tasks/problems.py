"""More problems as plain Dataset classes, and a loss and a metric of one's own.

- `LinePoints`: y = X w + b + noise, for task=regression (a linear model recovers w and b).
- `Tags`: K yes/no tags per sample (K-hot float targets), for task=multilabel.
- `focal_loss` and `BrierScore`: a loss function and a torchmetrics Metric of one's own, for
  task=custom (conf/task/focal.yaml).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from torchmetrics import Metric


class LinePoints(Dataset):
    """`n_samples` points x ~ N(0, 1) with targets x . weights + bias + N(0, noise^2), drawn from
    (`seed`, `part`): part 0 for training, 1 for validation."""

    def __init__(
        self, n_samples: int, weights: list[float], bias: float, noise: float, part: int, seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed * 2 + part)
        self.x = torch.randn(n_samples, len(weights), generator=g)
        w = torch.tensor(weights)
        self.y = self.x @ w + bias + noise * torch.randn(n_samples, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]  # a float scalar target per sample


class Tags(Dataset):
    """`n_samples` points with `num_tags` tags each: tag k is on where a fixed random linear
    teacher's k-th score is above 0.5 (several tags at once, or none); drawn from (`seed`,
    `part`): part 0 for training, 1 for validation."""

    def __init__(self, n_samples: int, input_dim: int, num_tags: int, part: int, seed: int) -> None:
        teacher = torch.randn(input_dim, num_tags, generator=torch.Generator().manual_seed(0))
        points = torch.Generator().manual_seed(seed * 2 + part)
        self.x = torch.randn(n_samples, input_dim, generator=points)
        self.y = (self.x @ teacher > 0.5).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def focal_loss(outputs: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Binary focal loss on logits (Lin et al. 2017): cross-entropy scaled by (1 - p_t)^gamma,
    so that easy samples count less."""
    targets = targets.reshape(outputs.shape).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(outputs, targets, reduction="none")
    p_t = torch.exp(-bce)
    return ((1 - p_t) ** gamma * bce).mean()


class BrierScore(Metric):
    """The mean squared difference between the predicted probability and the 0/1 target."""

    higher_is_better = False
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("squared", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        probabilities = torch.sigmoid(outputs.reshape(targets.shape).float())
        self.squared += ((probabilities - targets.float()) ** 2).sum()
        self.count += targets.numel()

    def compute(self) -> torch.Tensor:
        return self.squared / self.count
