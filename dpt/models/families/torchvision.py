"""torchvision's other classifiers, and any model dpt knows only by its parts: its blocks are
torchvision's repeated blocks found inside it (inverted residuals, MBConvs, ConvNeXt and
transformer blocks); an `nn.Sequential` cuts between its children."""

from __future__ import annotations

from torch import nn

from dpt.models.families.base import Family, Unit, outermost, sequential_units

# torchvision's repeated blocks, (module, class): each maps a tensor to a new tensor (not a
# view, which FSDP2 warns about: ShuffleNet's blocks end in a channel shuffle view), holds its own
# parameters and is registered in forward order. Named, not imported: no torchvision import to
# find out that a model has none.
BLOCKS = frozenset(
    {
        ("torchvision.models.mobilenetv2", "InvertedResidual"),
        ("torchvision.models.mobilenetv3", "InvertedResidual"),
        ("torchvision.models.efficientnet", "MBConv"),
        ("torchvision.models.efficientnet", "FusedMBConv"),
        ("torchvision.models.convnext", "CNBlock"),
        ("torchvision.models.regnet", "ResBottleneckBlock"),
        ("torchvision.models.mnasnet", "_InvertedResidual"),
        ("torchvision.models.swin_transformer", "SwinTransformerBlock"),
        ("torchvision.models.swin_transformer", "SwinTransformerBlockV2"),
        ("torchvision.models.vision_transformer", "EncoderBlock"),
    }
)


class ByPartsFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return True  # the last asked: what any model's parts say

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        return list(outermost(model, lambda c: (c.__module__, c.__name__) in BLOCKS))

    def units(self, model: nn.Module) -> list[Unit] | None:
        return sequential_units(model) if isinstance(model, nn.Sequential) else None
