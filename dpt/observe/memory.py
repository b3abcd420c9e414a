"""What the training state occupies on this rank: parameters, gradients, optimizer state.

Counted from the tensors this rank holds (under fsdp its shards: DTensor's local part), so the
numbers show what sharding saves per rank; activations and allocator caches are not included
(on CUDA the metrics also give the allocator's peak).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dpt.distributed import local_part

MB = 2**20


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (its shard, for a DTensor)."""
    local = local_part(tensor)
    return local.numel() * local.element_size()


class MemoryUse:
    """Per-rank sizes in MB, as metrics scalars (`memory/params_mb`, ...)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.sizes: dict[str, float] | None = None  # fixed once the optimizer has its state

    def scalars(self) -> dict[str, float]:
        """Counted at the first window after the optimizer made its state (its first step), then
        the same every window: nothing here changes size during a run."""
        if self.sizes is not None:
            return self.sizes
        sizes = self._count()
        if self.optimizer.state:
            self.sizes = sizes
        return sizes

    def _count(self) -> dict[str, float]:
        params = list(self.model.parameters())
        return {
            "memory/params_mb": _total(params),
            # A gradient has its parameter's shape, sharding and dtype. Counted from the
            # parameters: at log time the step has already set the gradients to None.
            "memory/grads_mb": _total(p for p in params if p.requires_grad),
            "memory/optimizer_mb": _total(self._optimizer_tensors()),
        }

    def _optimizer_tensors(self) -> Iterable[torch.Tensor]:
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _total(tensors: Iterable[torch.Tensor]) -> float:
    return sum(local_bytes(t) for t in tensors) / MB
