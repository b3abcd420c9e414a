"""A model's forward on the meta device: shapes only (no memory, no arithmetic, the weights
untouched), to learn what a model gives, or whether it takes the data set's inputs at all,
before the first step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call


def meta_forward(
    model: nn.Module,
    batch: int,
    input_shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
    training: bool = False,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Any:
    """The model's output for `batch` inputs of `input_shape` (and `dtype`: token ids are
    integers), as meta tensors, in eval mode (one sample: BatchNorm in training mode would want
    more), or in training mode; on `tensors` (`meta_tensors`: its parameters and buffers),
    fresh ones where None. Raises what the forward raises; NotImplementedError where an
    operation has no shape inference."""
    tensors = meta_tensors(model) if tensors is None else tensors
    was_training = model.training
    model.train(training)
    try:
        inputs = torch.empty(batch, *input_shape, device="meta", dtype=dtype)
        return functional_call(model, tensors, (inputs,))
    finally:
        model.train(was_training)


def meta_tensors(model: nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as meta tensors of their shapes; `grad`: each
    parameter asking for a gradient where the model's does."""
    params = {key: torch.empty_like(p, device="meta").requires_grad_(grad and p.requires_grad)
              for key, p in model.named_parameters()}  # fmt: skip
    return params | {key: torch.empty_like(b, device="meta") for key, b in model.named_buffers()}


def output_shape(
    model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> tuple[int, ...] | None:
    """One sample's output shape (B, ...) without the batch, or None where the meta forward
    cannot tell (a lazy layer, an operation without shape inference, an output that is not one
    tensor of the batch's length): the first step will tell then."""
    try:
        output = meta_forward(model, 2, input_shape, dtype)
    except Exception:  # anything the forward raises is the first step's to report
        return None
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != 2:
        return None
    return tuple(output.shape[1:])


def unused_parameters(
    model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> list[str] | None:
    """The trainable parameters that a training step's forward and backward leave without a
    gradient (a ViT's mask token, which only masked-image pretraining uses), found on the meta
    device; None where the meta forward cannot tell."""
    tensors = meta_tensors(model, grad=True)
    try:
        output = meta_forward(model, 2, input_shape, dtype, training=True, tensors=tensors)
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        output.float().sum().backward()
    except Exception:  # anything the forward raises is the first step's to report
        return None
    return [key for key, t in tensors.items() if t.requires_grad and t.grad is None]
