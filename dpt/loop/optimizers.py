"""Optimizers dpt builds itself, where torch's take no say in which parameters decay.

`adamw_gpt` (`optimizer=adamw_gpt`): AdamW as GPT-2 and nanoGPT train transformers: weight decay
on the matrices (linear layers' weights and the embeddings: every parameter of 2 or more
dimensions), none on the biases and normalization gains (the 1-dimensional ones), whose decay
only pulls them towards zero without regularizing anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def adamw_gpt(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """`params`: parameters, or dpt's groups of them (dpt/loop/param_groups.py: a group's own
    lr and weight decay kept, the decay still on its matrices only)."""
    groups: list[dict[str, Any]] = []
    for group in _as_groups(params):
        trainable = [p for p in group["params"] if p.requires_grad]
        rest = {k: v for k, v in group.items() if k not in ("params", "weight_decay")}
        decay = group.get("weight_decay", weight_decay)
        groups += [
            {**rest, "params": [p for p in trainable if p.dim() >= 2], "weight_decay": decay},
            {**rest, "params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]
    kept = [g for g in groups if g["params"]]
    return torch.optim.AdamW(kept, lr=lr, betas=tuple(betas), fused=fused)


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return items
    return [{"params": items}]


def fused_fits(model: nn.Module) -> bool:
    """Whether torch's fused Adam kernel takes every parameter that trains: floating point, on
    a device that has the kernel (the CPU and CUDA do; DTensors' local shards too)."""
    devices = _get_fused_kernels_supported_devices()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return all(p.is_floating_point() and p.device.type in devices for p in trainable)
