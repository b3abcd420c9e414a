"""The synthetic task read one sample at a time, with the samples from `slow_from` on taking
`sleep_s` each to load: a loader that slows down part way through an epoch."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import Dataset

from dpt.data.synthetic import SyntheticData


class SlowSamples(Dataset):
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, slow_from: int, sleep_s: float):
        self.inputs, self.labels = inputs, labels
        self.slow_from, self.sleep_s = slow_from, sleep_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index >= self.slow_from:
            time.sleep(self.sleep_s)
        return self.inputs[index], int(self.labels[index])


class SlowData(SyntheticData):
    def __init__(self, slow_from: int, sleep_s: float, **synthetic: Any) -> None:
        super().__init__(**synthetic)  # the synthetic task's keys and seed
        self.train = SlowSamples(*self.train.tensors, slow_from, sleep_s)
