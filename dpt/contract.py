"""The contract between dpt and a user's own model and data set, written once.

A **model** target (`model._target_`, a class or function) is called with its config's keys and
`num_classes=`; it also gets `input_shape=` (the data set's `(C, H, W)` or `(features,)`) only
if its signature names that parameter (or takes `**kwargs`). It returns a `torch.nn.Module`
whose forward maps a batch of inputs to logits of shape `(batch, num_classes)`.

A **data set** target (`dataset._target_`) is called with its config's keys and `seed=`
(`trainer.seed`: draw anything random from it, so every rank builds the same sets) and returns
an object shaped as `DataModule` below. `dpt` shards, shuffles, batches and seeds augmentation
itself: a training sample's random draws come from torch's generator seeded from (seed, epoch,
index), so a transform that draws from torch's global generator resumes exactly.

README.md ("Your own model and data") and `examples/own_model/` show both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import Dataset


@runtime_checkable
class DataModule(Protocol):
    """What a `dataset` target returns.

    Required:
    - `train`: a map-style `Dataset` whose item `i` is `(input, label)` (a tensor and an int),
      or None for a sample that cannot be read (skipped and counted, like a bad image);
    - `val`: the same for validation, or None for no validation;
    - `input_shape`: one input's shape, e.g. `(3, 224, 224)`;
    - `num_classes`: the number of classes (labels are `0 .. num_classes - 1`);
    - `num_workers`: DataLoader worker processes per rank (0 = load in the rank itself).

    Optional (read with a default, see `class_names` and `val_transform_node`):
    - `classes`: the class names in label order (default: "0", "1", ...); saved in the run
      folder, printed by `dpt-predict`;
    - `val_transform`: a `_target_` node (a dict) that builds the callable turning one decoded
      image (a uint8 `(3, H, W)` RGB tensor) into the model's input, as validation does. Saved in
      the run folder; `dpt-predict` needs it.
    """

    train: Dataset
    val: Dataset | None
    input_shape: tuple[int, ...]
    num_classes: int
    num_workers: int


def class_names(data: DataModule) -> list[str]:
    """The data set's class names in label order; their numbers where it gives none."""
    names = getattr(data, "classes", None)
    if names is None:
        return [str(label) for label in range(data.num_classes)]
    names = [str(name) for name in names]
    if len(names) != data.num_classes:
        from dpt.errors import DptError

        raise DptError(
            f"the data set lists {len(names)} class names for num_classes={data.num_classes}"
        )
    return names


def val_transform_node(data: DataModule) -> dict[str, Any] | None:
    """The `_target_` node of the data set's validation transform, or None."""
    node = getattr(data, "val_transform", None)
    return dict(node) if isinstance(node, dict) else None


def model_kwargs(
    target: Callable[..., Any], input_shape: Sequence[int], num_classes: int
) -> dict[str, Any]:
    """The keywords dpt adds to a model target's own: `num_classes`, and `input_shape` where the
    target's signature takes it."""
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    if _takes(target, "input_shape"):
        kwargs["input_shape"] = tuple(input_shape)
    return kwargs


def _takes(target: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass only what is required
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
