"""Augmentation that resumes exactly: each training sample's random draws come from its own seed.

torchvision's random transforms (RandomResizedCrop, RandomHorizontalFlip, ...) draw from torch's
global generator, which in a loader worker depends on the worker count and on which samples the
worker fetched before. Seeding that generator from (seed, epoch, sample index) for the time of
one sample makes the draws independent of workers, world size, batch size and interruptions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from dpt.seeding import derived_seed


class SeededSamples(Dataset):
    """The training set as its loader sees it: keyed by (epoch, index) pairs (what
    GlobalOrderSampler yields), each sample fetched with torch's CPU generator seeded from
    (seed, epoch, index), and the generator's previous state restored after it.

    A dataset that fetches whole batches (`__getitems__`, dpt's in-memory tensors) is asked for
    the batch at once, unseeded: such a fetch has no per-sample transforms to seed."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        # The CPU generator only (torch.manual_seed would also reseed CUDA's): transforms run on
        # the CPU, and a worker-less loader must leave the training's own streams alone.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derived_seed(self.seed, epoch, index))
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:
            return batched([index for _, index in keys])
        return [self[key] for key in keys]
