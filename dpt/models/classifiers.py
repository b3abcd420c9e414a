"""Any classification model of torchvision's registry (`model=torchvision model.name=...`), with
the head sized to the data set; weights only from a local file, nothing is ever downloaded."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torchvision
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpt.errors import ConfigError, DptError, first_line
from dpt.models.meta import meta_forward
from dpt.models.weights import load_weights

LIST_HINT = (
    'list them with: python -c "import torchvision.models as m; print(m.list_models(module=m))"'
)
# torchvision's registries of other tasks: a name there is a known model, just not a classifier.
OTHER_TASKS = ("detection", "segmentation", "video", "optical_flow", "quantization")
# Models whose training-mode forward returns (logits, aux logits) unless built without them.
AUX_LOGITS = ("googlenet", "inception_v3")
# Keywords of the builder that dpt sets itself.
OWN_KEYWORDS = {"num_classes": "set from the dataset", "weights": "use model.weights (a file)"}


def classification_models() -> list[str]:
    """The names of torchvision's image classification models, e.g. efficientnet_b0."""
    return torchvision.models.list_models(module=torchvision.models)


def check_name(name: str) -> None:
    """One line if `name` is not a torchvision classification model (builds nothing)."""
    models = classification_models()
    if name in models:
        return
    task = _other_task(name)
    if task:
        raise ConfigError(
            f"model.name={name}: a torchvision {task} model, not a classification model; "
            + LIST_HINT
        )
    close = _close_matches(name, models)
    hint = f"close matches: {', '.join(close)}" if close else LIST_HINT
    raise ConfigError(f"model.name={name}: not a torchvision classification model; {hint}")


def _close_matches(name: str, models: list[str], n: int = 5) -> list[str]:
    """difflib.get_close_matches's choice, with ties in alphabetical order (efficientnet_b0
    before efficientnet_b7), not the reverse."""
    score = {model: difflib.SequenceMatcher(None, model, name).ratio() for model in models}
    ranked = sorted(models, key=lambda model: (-score[model], model))
    return [model for model in ranked if score[model] >= 0.6][:n]


def _other_task(name: str) -> str | None:
    for task in OTHER_TASKS:
        module = getattr(torchvision.models, task)
        if name in torchvision.models.list_models(module=module):
            return task.replace("_", " ")
    return None


def torchvision_classifier(
    input_shape: tuple[int, ...],
    num_classes: int,
    name: str,
    weights: str | None,
    channels_last: bool,
    options: Mapping[str, Any],
) -> nn.Module:
    label = f"torchvision ({name})"
    if len(input_shape) != 3:
        raise DptError(
            f"model={label} takes images (C, H, W), but the dataset gives inputs of shape "
            f"{tuple(input_shape)} (use model=mlp for vectors)"
        )
    check_name(name)
    model = _build(name, num_classes, _options(options))
    _check_takes(model, label, tuple(input_shape))
    if weights:
        load_weights(model, Path(weights), label, num_classes)
    if channels_last:
        # NHWC lets cuDNN use tensor-core convolutions without layout transposes.
        model = model.to(memory_format=torch.channels_last)
    return model


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    given = options or {}
    plain = dict(
        OmegaConf.to_container(given, resolve=True) if isinstance(given, DictConfig) else given
    )
    for key, why in OWN_KEYWORDS.items():
        if key in plain:
            raise ConfigError(f"model.options.{key}: not an option of model=torchvision ({why})")
    return plain


def _keywords(name: str, options: dict[str, Any]) -> dict[str, Any]:
    if name in AUX_LOGITS:
        # Logits only, as every other model returns. init_weights=True is the builders' own
        # default, given so that they do not warn that it will change.
        return {"aux_logits": False, "init_weights": True, **options}
    return options


def _build(name: str, num_classes: int, options: dict[str, Any]) -> nn.Module:
    try:
        return torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, **_keywords(name, options)
        )
    except (TypeError, ValueError, AssertionError, RuntimeError) as error:
        raise DptError(
            f"model=torchvision ({name}): torchvision cannot build it with "
            f"model.options={options} ({first_line(error)})"
        ) from error


def _check_takes(model: nn.Module, label: str, input_shape: tuple[int, ...]) -> None:
    """Run one input of the data set's shape through the model on the meta device (shapes only:
    no memory, no arithmetic, the weights untouched), so that a model that cannot take the data
    set's images (too small for inception_v3, not the size a ViT was built for) fails here, in
    one line, not in the first step's traceback."""
    try:
        meta_forward(model, 1, input_shape)
    except NotImplementedError:
        return  # an operation without shape inference: the first step will tell
    except (RuntimeError, AssertionError, ValueError) as error:
        raise DptError(
            f"model={label} does not take the dataset's images of shape {input_shape}: "
            f"{first_line(error)}{_size_hint(model, input_shape)}"
        ) from error


def _size_hint(model: nn.Module, input_shape: tuple[int, ...]) -> str:
    # ViTs are built for one image size (`image_size`, 224 unless given).
    built_for = getattr(model, "image_size", None)
    if isinstance(built_for, int) and input_shape[1:] != (built_for, built_for):
        height, width = input_shape[1:]
        if height != width:
            return f" (it takes square images of model.options.image_size px, {built_for} now)"
        return f" (it is built for {built_for}x{built_for}: set model.options.image_size={height})"
    if input_shape[0] != 3:
        return " (torchvision's models take 3-channel images)"
    return " (larger images may fit)"
