"""The contract between dpt and a user's own model and data set, written once.

A **model** target (`model._target_`, a class or function) is called with its config's keys, and
with those of dpt's keywords its signature names: `num_classes` and `num_outputs` (both the
outputs per sample the task needs: one per class, per target column or per regression value) and
`input_shape` (the data set's `(C, H, W)` or `(features,)`). A target that takes `**kwargs` gets
`num_classes` and `input_shape`. It returns a `torch.nn.Module`; what its forward must give is
the task's to say (`dpt.tasks.fit`: logits `(batch, num_outputs)` for the built-in tasks).

A **data set** is either plain `Dataset` classes (`dataset=custom`: `dataset.train._target_`,
`dataset.val._target_`, each item an `(input, target)` pair, the input shape read from the first
sample), or a target (`dataset._target_`) called with its config's keys and `seed=`
(`trainer.seed`: draw anything random from it, so every rank builds the same sets) that returns
an object shaped as `DataModule` below. A target is an int class label or a tensor of numbers
(`dpt.targets.Targets`). `dpt` shards, shuffles, batches and seeds augmentation itself: a
training sample's random draws come from torch's generator seeded from (seed, epoch, index), so
a transform that draws from torch's global generator resumes exactly.

docs/guides/own-model-and-data.md, docs/guides/tasks.md and `examples/own_model/` show both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import Dataset

from dpt.errors import DptError
from dpt.targets import Targets


@runtime_checkable
class DataModule(Protocol):
    """What a `dataset` target returns.

    Required:
    - `train`: a map-style `Dataset` whose item `i` is `(input, target)` (a tensor, and an int
      label or a tensor of numbers), or None for a sample that cannot be read (skipped and
      counted, like a bad image);
    - `val`: the same for validation, or None for no validation;
    - `input_shape`: one input's shape, e.g. `(3, 224, 224)`;
    - `num_classes`: the number of classes (labels are `0 .. num_classes - 1`); only
      `task=classification` needs it, the other tasks read the targets;
    - `num_workers`: DataLoader worker processes per rank (0 = load in the rank itself).

    Optional (read with a default, see `class_names`, `val_transform_node`, `target_spec`):
    - `classes`: the class names in label order, or the names of the outputs (target columns,
      labels, regression values) (default: "0", "1", ...); saved in the run folder, printed by
      `dpt-predict`;
    - `target_spec`: a `dpt.targets.Targets` saying what every target is, where reading the
      first sample to find out would cost (a download); default: the first readable sample's;
    - `input_dtype`: the inputs' torch dtype where it is not float (token ids: `torch.long`);
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
    return output_names(data, data.num_classes, classification=True)


def output_names(data: DataModule, outputs: int, classification: bool) -> list[str]:
    """The names of the model's outputs: the data set's `classes` (of the classes, or of the
    target columns, labels or values), or their numbers where it gives none. Two classes for
    one output (task=binary): the output is the probability of the second (label 1), named
    after it."""
    names = getattr(data, "classes", None)
    if names is None:
        return [str(i) for i in range(outputs)]
    names = [str(name) for name in names]
    if not classification and outputs == 1 and len(names) == 2:
        return names[1:]
    if len(names) != outputs:
        what = f"class names for num_classes={outputs}" if classification else (
            f"names for its {outputs} outputs per sample")  # fmt: skip
        raise DptError(f"the data set lists {len(names)} {what}")
    return names


def val_transform_node(data: DataModule) -> dict[str, Any] | None:
    """The `_target_` node of the data set's validation transform, or None."""
    node = getattr(data, "val_transform", None)
    return dict(node) if isinstance(node, dict) else None


def model_kwargs(
    target: Callable[..., Any],
    input_shape: Sequence[int],
    num_outputs: int,
    task: str | None = None,
) -> dict[str, Any]:
    """The keywords dpt adds to a model target's own: those of `num_classes`, `num_outputs`,
    `input_shape` and `task` (the task's kind, where known) its signature names; `num_classes`
    and `input_shape` for `**kwargs`."""
    offered = {"num_classes": num_outputs, "num_outputs": num_outputs,
               "input_shape": tuple(input_shape), "task": task}  # fmt: skip
    named = _named(target)
    if named is None:  # **kwargs
        return {k: offered[k] for k in ("num_classes", "input_shape")}
    return {k: v for k, v in offered.items() if k in named}


def _named(target: Callable[..., Any]) -> set[str] | None:
    """The parameter names of `target`'s signature; None where it takes `**kwargs`."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: what it requires, as before
        return {"num_classes"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def takes_keyword(target: Callable[..., Any], name: str) -> bool:
    """Whether `target` can be called with `name=` (named, or `**kwargs`)."""
    named = _named(target)
    return named is None or name in named


# Samples read, at most, to find the first readable one (an unreadable sample is None).
FIRST_SAMPLE_TRIES = 100


def first_sample(dataset: Dataset, key: str) -> tuple[Any, Any]:
    """The first readable `(input, target)` item of `dataset` (`key` names it in errors): what
    a data set's input shape and targets are read from."""
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise DptError(f"{key}: the data set is empty")
    for index in range(min(size, FIRST_SAMPLE_TRIES)):
        item = dataset[index]
        if item is None:
            continue
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise DptError(
                f"{key}: item {index} is a {type(item).__name__}, not an (input, target) pair"
            )
        return item[0], item[1]
    raise DptError(f"{key}: its first {min(size, FIRST_SAMPLE_TRIES)} samples are all unreadable")


def targets_of(data: DataModule) -> Targets:
    """What the data set's targets are: as it declares them (`target_spec`), else as its first
    readable training sample's, with its class count where it gives one."""
    declared = getattr(data, "target_spec", None)
    if isinstance(declared, Targets):
        return declared
    spec = Targets.of(first_sample(data.train, "dataset.train")[1])
    return spec.with_classes(getattr(data, "num_classes", None))


def input_dtype(data: DataModule) -> Any:
    """The data set's inputs' dtype (`input_dtype`; torch's default float where it gives none):
    an empty batch must have it too."""
    import torch

    return getattr(data, "input_dtype", None) or torch.get_default_dtype()
