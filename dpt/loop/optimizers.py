"""Optimizers dpt builds itself, where torch's take no say in which parameters decay.

`adamw_gpt` (`optimizer=adamw_gpt`): AdamW as GPT-2 and nanoGPT train transformers: weight decay
on the matrices (linear layers' weights and the embeddings: every parameter of 2 or more
dimensions), none on the biases and normalization gains (the 1-dimensional ones), whose decay
only pulls them towards zero without regularizing anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def adamw_gpt(
    params: Iterable[nn.Parameter], lr: float, weight_decay: float, betas: Sequence[float]
) -> torch.optim.AdamW:
    trainable = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))
