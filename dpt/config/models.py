"""`model`: dpt's own models (dpt/models); a model of yours is any `_target_` with its keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from dpt.config.checks import one_of

RESNET_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")  # model.arch of model=resnet*


@dataclass
class MLPConfig:
    _target_: str = "dpt.models.mlp.MLP"
    hidden_dims: list[int] = MISSING
    # Recompute each block's activations in backward (not passed to `_target_`: see build_model).
    activation_checkpointing: bool = MISSING


@dataclass
class ResNetConfig:
    _target_: str = "dpt.models.resnet.resnet"
    arch: str = one_of(RESNET_ARCHS)
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    activation_checkpointing: bool = MISSING


@dataclass
class GPTConfig:
    """A decoder-only transformer in the GPT-2 shape (dpt/models/gpt.py)."""

    _target_: str = "dpt.models.gpt.GPT"
    block_size: int = MISSING  # the longest sequence; dataset=text's windows read it
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    dropout: float = MISSING
    bias: bool = MISSING  # biases in the linear layers and LayerNorms
    vocab_size: int | None = MISSING  # null: the data's; larger pads the embedding (e.g. to 64s)
    activation_checkpointing: bool = MISSING


@dataclass
class TorchvisionModelConfig:
    """Any classification model of torchvision's registry, by name (dpt/models/classifiers.py)."""

    _target_: str = "dpt.models.classifiers.torchvision_classifier"
    name: str = MISSING  # torchvision.models.list_models(torchvision.models), e.g. efficientnet_b0
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    options: dict[str, Any] = MISSING  # more keyword arguments of the builder, e.g. {dropout: 0.3}
    activation_checkpointing: bool = MISSING


MODELS: dict[str, type] = {
    "mlp": MLPConfig,
    "resnet18": ResNetConfig,
    "resnet50": ResNetConfig,
    "torchvision": TorchvisionModelConfig,
    "gpt": GPTConfig,
}
