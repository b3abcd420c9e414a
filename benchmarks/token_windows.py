"""A token file read as the hand-written loops read it: window i is tokens[i*T : i*T + T + 1]
(the inputs, and the targets one token later), at non-overlapping offsets, a batch of windows
fetched in one indexing op through a memory map (numpy and torch only: nothing of dpt)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class Windows:
    """Window i of the token file: tokens[i*T : i*T + T + 1] (inputs, and targets one later)."""

    def __init__(self, path: Path, count: int, dtype: str, block_size: int) -> None:
        self.tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        self.block_size = block_size
        self.offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def window(self, indices: list[int]) -> torch.Tensor:
        """The windows of `indices` (len(indices), T + 1), in one indexing op."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.block_size
        return torch.from_numpy(self.tokens[starts + self.offsets].astype(np.int64))

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets of the windows of `indices`."""
        window = self.window(indices)
        return window[:, :-1], window[:, 1:]
