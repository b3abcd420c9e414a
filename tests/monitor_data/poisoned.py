"""The synthetic task, with the training samples of a window of indices poisoned: with
`dataset.shuffle=false` they land in known steps (step k of batch B holds indices
[(k - 1) * B, k * B))."""

from __future__ import annotations

from typing import Any

import torch

from dpt.data.loaders import InMemoryDataset
from dpt.data.synthetic import SyntheticData


class PoisonedData(SyntheticData):
    """`poison`: "scale" multiplies the window's inputs by `factor` (a loss spike), "zero"
    sets their first feature to 0 (a division by zero in `dividing.DividingNet`), "none"
    leaves them as they are (the clean run), "drop" leaves them out (the run that never saw
    them: the later samples move up into their places)."""

    def __init__(
        self, poison_start: int, poison_end: int, poison: str, factor: float, **synthetic: Any
    ) -> None:
        super().__init__(**synthetic)  # the synthetic task's keys and seed
        inputs = self.train.tensors[0]
        window = slice(poison_start, poison_end)
        if poison == "scale":
            inputs[window] *= factor
        elif poison == "zero":
            inputs[window, 0] = 0.0
        elif poison == "drop":
            keep = torch.ones(len(inputs), dtype=torch.bool)
            keep[window] = False
            self.train = InMemoryDataset(inputs[keep], self.train.tensors[1][keep])
        elif poison != "none":
            raise ValueError(f"poison={poison}: scale, zero, drop or none")
