"""Numeric precision of the forward and backward pass: fp32, bf16 autocast, fp16 with a scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpt.distributed import is_dtensor, local_part
from dpt.errors import DptError


class Precision:
    """Autocast for the forward pass, and (fp16 only) a GradScaler around backward and step."""

    def __init__(
        self,
        precision: str,
        device: torch.device,
        grad_norm: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> None:
        """`grad_norm`: the strategy's own global norm (a pipeline's, over its stages)."""
        if precision == "16-mixed" and device.type != "cuda":
            raise DptError(
                f"trainer.precision=16-mixed needs CUDA (device is {device.type}); use bf16-mixed"
            )
        self.device_type = device.type
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
        self._unscaled = False  # the scaler's unscale_ ran this step (once a step, at most)
        self.grad_norm = grad_norm

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip_and_norm(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        """Global gradient norm before clipping (None when not clipping: computing it costs)."""
        if max_norm is None:
            return None
        self.unscale(optimizer)  # clip the true gradients, not the scaled ones
        # A strategy's own norm (a pipeline's: every stage's squares) is the same on every rank.
        norm = self.grad_norm(model) if self.grad_norm is not None else None
        return clip_by_global_norm(list(model.parameters()), max_norm, norm)

    def norm(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The gradients' norm, without clipping and without a collective: under fsdp this
        rank's shards' alone (the monitor sums the ranks' squares at its agreement)."""
        self.unscale(optimizer)  # the true gradients' norm
        if self.grad_norm is not None:  # a collective, but the whole model's norm
            return self.grad_norm(model)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return local_part(nn.utils.get_total_norm(grads))

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """16-mixed: the gradients divided by the loss scale, once a step (the scaler's step
        knows they are)."""
        if self.scaler and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def state_dict(self) -> dict[str, Any]:
        """The fp16 loss scale and its growth tracker ({} when there is no scaler)."""
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step if the scaled gradients overflowed
            self.scaler.update()
            self._unscaled = False
        else:
            optimizer.step()

    def skip_step(self) -> None:
        """The update is withheld (the monitor's skip): a scaler that unscaled this step's
        gradients closes the step with its inf check, or the next unscale_ would refuse."""
        if self.scaler and self._unscaled:
            self.scaler.update()
        self._unscaled = False


def clip_by_global_norm(
    params: list[nn.Parameter], max_norm: float, norm: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale the gradients so that their norm over the whole model (`norm`, where the strategy
    computed it) is at most `max_norm`; returns that norm before clipping. Under fsdp each rank
    holds shards of the gradients (DTensors): their norm is a partial one until summed over the
    ranks (`full_tensor`), and every rank must clip by the same, global, norm."""
    if norm is None:
        norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if is_dtensor(norm):
            norm = norm.full_tensor()
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
