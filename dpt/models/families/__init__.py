"""Model families: what dpt knows of each kind of model, asked of one object
(dpt/models/families/base.py says what it answers). A new family is one file here and one entry
in `FAMILIES`.
"""

from __future__ import annotations

from torch import nn

from dpt.models.families.base import Family
from dpt.models.families.gpt import GPTFamily
from dpt.models.families.mlp import MLPFamily
from dpt.models.families.resnet import ResNetFamily
from dpt.models.families.torchvision import ByPartsFamily
from dpt.models.families.transformers import TransformersFamily

# Asked in this order; the last owns any model (what its parts say: torchvision's blocks, an
# nn.Sequential's children).
FAMILIES: tuple[Family, ...] = (
    GPTFamily(),
    MLPFamily(),
    ResNetFamily(),
    TransformersFamily(),
    ByPartsFamily(),
)


def family_of(model: nn.Module) -> Family:
    """The family that owns `model` (a bare model: without DDP's or torch.compile's wrapper)."""
    return next(family for family in FAMILIES if family.owns(model))
