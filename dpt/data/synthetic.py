"""An in-memory classification task that runs anywhere in seconds."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from dpt.data.loaders import InMemoryDataset


class SyntheticData:
    """Gaussian inputs labelled by a fixed random linear teacher.

    Everything is drawn from its own generator seeded with `seed`, so every rank builds the same
    tensors without any communication, and the task is learnable (a linear model can reach 100%).
    """

    def __init__(
        self,
        num_samples: int,
        num_val_samples: int,
        input_dim: int,
        num_classes: int,
        num_workers: int,
        seed: int,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        teacher = torch.randn(input_dim, num_classes, generator=g)
        x = torch.randn(num_samples + num_val_samples, input_dim, generator=g)
        y = (x @ teacher).argmax(dim=1)
        self.train = InMemoryDataset(x[:num_samples], y[:num_samples])
        self.val: Dataset | None = (
            InMemoryDataset(x[num_samples:], y[num_samples:]) if num_val_samples else None
        )
        self.input_shape: tuple[int, ...] = (input_dim,)
        self.num_classes = num_classes
        self.num_workers = num_workers
