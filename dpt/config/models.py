"""`model`: dpt's own models (dpt/models); a model of yours is any `_target_` with its keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from dpt.config.checks import one_of
from dpt.errors import ConfigError

HF_CONFIG = "config.json"  # what makes a folder a transformers model's

RESNET_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")  # model.arch of model=resnet*
# Every model's key for its initial weights: loaded by dpt (dpt.loop.parts.initial_weights),
# not passed to `_target_`.
INIT_KEY = "init_from"
GELU_APPROXIMATIONS = ("none", "tanh")  # model.gelu of model=gpt: F.gelu's `approximate`


@dataclass
class MLPConfig:
    _target_: str = "dpt.models.mlp.MLP"
    hidden_dims: list[int] = MISSING
    # Recompute each block's activations in backward (not passed to `_target_`: see build_model).
    # Weights to start from (a run folder, a .pt, a checkpoint, safetensors, a transformers
    # folder): loaded by dpt, not passed to `_target_` (dpt.loop.parts.initial_weights).
    init_from: str | None = MISSING
    activation_checkpointing: bool = MISSING


@dataclass
class ResNetConfig:
    _target_: str = "dpt.models.resnet.resnet"
    arch: str = one_of(RESNET_ARCHS)
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    # Weights to start from (a run folder, a .pt, a checkpoint, safetensors, a transformers
    # folder): loaded by dpt, not passed to `_target_` (dpt.loop.parts.initial_weights).
    init_from: str | None = MISSING
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
    gelu: str = one_of(GELU_APPROXIMATIONS)  # tanh: GPT-2's gelu_new (its weights need it)
    vocab_size: int | None = MISSING  # null: the data's; larger pads the embedding (e.g. to 64s)
    # Weights to start from (a run folder, a .pt, a checkpoint, safetensors, a transformers
    # folder): loaded by dpt, not passed to `_target_` (dpt.loop.parts.initial_weights).
    init_from: str | None = MISSING
    activation_checkpointing: bool = MISSING


@dataclass
class TorchvisionModelConfig:
    """Any classification model of torchvision's registry, by name (dpt/models/classifiers.py)."""

    _target_: str = "dpt.models.classifiers.torchvision_classifier"
    name: str = MISSING  # torchvision.models.list_models(torchvision.models), e.g. efficientnet_b0
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    options: dict[str, Any] = MISSING  # more keyword arguments of the builder, e.g. {dropout: 0.3}
    # Weights to start from (a run folder, a .pt, a checkpoint, safetensors, a transformers
    # folder): loaded by dpt, not passed to `_target_` (dpt.loop.parts.initial_weights).
    init_from: str | None = MISSING
    activation_checkpointing: bool = MISSING


@dataclass
class HFModelConfig:
    """A Hugging Face transformers model from a local folder or a config (dpt/models/hf.py)."""

    _target_: str = "dpt.models.hf.pretrained"
    path: str | None = MISSING  # a folder written by save_pretrained; nothing is downloaded
    # no folder: transformers config keys, model_type (Any: a dict given whole, by any keys)
    config: Any = MISSING
    block_size: int = MISSING  # the longest sequence; dataset=text's windows read it
    trust_remote_code: bool = MISSING  # run the folder's own code (config.json's auto_map)
    init_from: str | None = MISSING
    activation_checkpointing: bool = MISSING


MODELS: dict[str, type] = {
    "mlp": MLPConfig,
    "resnet18": ResNetConfig,
    "resnet50": ResNetConfig,
    "torchvision": TorchvisionModelConfig,
    "gpt": GPTConfig,
    "hf": HFModelConfig,
}


def check_model_folder(path: str) -> Path:
    """`model.path` as a transformers model's folder, refused in one line where it is none:
    before anything that reads from it (dataset.tokenizer defaults to it)."""
    folder = Path(path)
    if not (folder / HF_CONFIG).is_file():
        where = "no such folder" if not folder.exists() else f"no {HF_CONFIG} there"
        raise ConfigError(f"model.path={path}: {where} (a folder written by transformers' "
                          "save_pretrained; nothing is downloaded)")  # fmt: skip
    return folder
