"""What a sample's target is, as every task checks it: integer class labels, or numbers of one
shape (a 0/1 column, a K-hot row, a regression value or vector).

Torch-free at import: the launching process describes the targets of dpt's own data sets from
their config alone (`dpt.config.datasets.declared_targets`) before any process starts; a built
data set's targets are read from its first readable sample (`Targets.of`).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# A target position that is not scored (torch's cross-entropy default): dataset=chat's targets
# outside the answers, left out of task=language_model's loss and perplexity.
IGNORE_INDEX = -100


class Targets:
    """One sample's target: integer or float, and its shape (`()` for a label or a scalar).

    A plain class, not a dataclass: Hydra's `instantiate` would turn a dataclass passed to a
    task's constructor into a config node."""

    __slots__ = ("classes", "integer", "shape")

    def __init__(self, integer: bool, shape: tuple[int, ...], classes: int | None = None) -> None:
        self.integer, self.shape = bool(integer), tuple(shape)
        self.classes = classes  # integer labels: how many the data set says it has, if known

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Targets) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"Targets(integer={self.integer}, shape={self.shape}, classes={self.classes})"

    def _fields(self) -> tuple[Any, ...]:
        return self.integer, self.shape, self.classes

    def with_classes(self, classes: int | None) -> Targets:
        return Targets(self.integer, self.shape, classes)

    @classmethod
    def labels(cls, classes: int | None = None) -> Targets:
        """Integer class labels `0 .. classes - 1`, one per sample."""
        return cls(integer=True, shape=(), classes=classes)

    @classmethod
    def of(cls, target: Any) -> Targets:
        """The description of one sample's target: a Python number, a tensor or an array."""
        if isinstance(target, bool | Integral):
            return cls(integer=True, shape=())
        if isinstance(target, Real):
            return cls(integer=False, shape=())
        import torch

        tensor = torch.as_tensor(target)
        return cls(integer=not tensor.is_floating_point(), shape=tuple(tensor.shape))

    @property
    def is_labels(self) -> bool:
        return self.integer and self.shape == ()

    @property
    def width(self) -> int:
        """Numbers per sample: 1 for a label or a scalar, K for a K-hot row."""
        return math.prod(self.shape)

    def batch_shape(self) -> str:
        return batch_shape(self.shape)

    def text(self) -> str:
        """`integer class labels (B,)`, `float (B, 1)`: as error lines name them."""
        if self.is_labels:
            return "integer class labels (B,)"
        return f"{'integer' if self.integer else 'float'} {self.batch_shape()}"

    def stack(self, values: list[Any]) -> torch.Tensor:
        """A batch of targets (the loaders' collate): labels as one int64 tensor, as before any
        other kind existed; anything else stacked as given (a float64 array stays float64: the
        task casts what its loss needs)."""
        import torch

        if self.is_labels:
            return torch.as_tensor([int(value) for value in values], dtype=torch.long)
        return torch.stack([torch.as_tensor(value) for value in values])

    def empty(self) -> torch.Tensor:
        """A batch of no targets (every sample of it unreadable), of the right kind and shape."""
        import torch

        dtype = torch.long if self.integer else torch.get_default_dtype()
        return torch.empty((0, *self.shape), dtype=dtype)


def batch_shape(shape: tuple[int, ...]) -> str:
    """`(B,)`, `(B, 10)`: a batch of per-sample `shape` (a size declared but not yet known, -1,
    as K: COCO's categories before its annotation file is read)."""
    sizes = "".join(f", {'K' if n < 0 else n}" for n in shape)
    return f"(B{sizes})" if shape else "(B,)"
