"""torchvision's ResNets: their residual blocks (each stage's children), cut between them."""

from __future__ import annotations

import torch
from torch import nn

from dpt.models.families.base import Family, Unit, child, loaded_instance

STAGES = ("layer1", "layer2", "layer3", "layer4")


class ResNetFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return loaded_instance(model, "torchvision.models.resnet", "ResNet")

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        return [block for stage in STAGES for block in getattr(model, stage)]

    def units(self, model: nn.Module) -> list[Unit]:
        def stem(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m.maxpool(m.relu(m.bn1(m.conv1(x))))

        def head(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m.fc(torch.flatten(m.avgpool(x), 1))

        blocks = [Unit(f"{layer}.{i}", (f"{layer}.{i}",), child(f"{layer}.{i}"))
                  for layer in STAGES for i in range(len(getattr(model, layer)))]  # fmt: skip
        return [Unit("stem", ("conv1", "bn1", "relu", "maxpool"), stem), *blocks,
                Unit("head", ("avgpool", "fc"), head)]  # fmt: skip
