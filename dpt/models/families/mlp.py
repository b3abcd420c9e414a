"""dpt's MLP (model=mlp): its blocks are its linear layers; it cuts between its children."""

from __future__ import annotations

from torch import nn

from dpt.models.families.base import Family, Unit, sequential_units
from dpt.models.mlp import MLP


class MLPFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, MLP)

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        return [layer for layer in model
                if layer is not None and any(True for _ in layer.parameters())]  # fmt: skip

    def units(self, model: nn.Module) -> list[Unit]:
        return sequential_units(model)
