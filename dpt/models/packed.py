"""Packed windows (dataset=chat): several examples in one window, the input (B, 2, T) holding
the token ids and each example's positions, restarting at 0 where an example starts. A model
that takes them (dpt's GPT, transformers models) gives each example the logits it would have
alone: its positions from 0, its attention within itself."""

from __future__ import annotations

import torch

PACKED_DIMS = 3  # (B, 2, T): ids and positions; token ids alone are (B, T)


def split(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token ids (B, T), positions (B, T) or None where the input is ids alone)."""
    if inputs.dim() == PACKED_DIMS:
        return inputs[:, 0], inputs[:, 1]
    return inputs, None


def attention_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) booleans for scaled_dot_product_attention: True where a query may attend a
    key: an earlier (or the same) position of the same example. An example starts where its
    position is 0."""
    example = torch.cumsum(positions == 0, dim=-1)
    same = example[:, :, None] == example[:, None, :]
    steps = positions.shape[-1]
    causal = torch.ones(steps, steps, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]
