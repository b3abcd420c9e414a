"""What the loop asks of a task (`Task`), and how one is built for a run's data set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import nn

from dpt.config.build import build_as
from dpt.config.tasks import LOSS, CustomTaskConfig, TaskFacts, higher_is_better, schema_of_target
from dpt.errors import DptError
from dpt.targets import Targets
from dpt.tasks import fit


class Task:
    """The loss, the validation metrics and the prediction of one kind of problem.

    Built once per run (`build_task`) with its config's keys and what the data set's targets
    are: `targets`, `num_outputs` (the model's outputs per sample) and `names` (of the classes
    or outputs, for `dpt-predict`). Its loss modules move with `to(device)`."""

    # Its training loss is cross-entropy over the last dimension, which torch's `loss_parallel`
    # computes on logits split over it: under tensor parallelism no rank gathers them whole.
    loss_on_split_logits: ClassVar[bool] = False

    def __init__(
        self, *, targets: Targets, num_outputs: int, names: list[str], watch: str, mode: str
    ) -> None:
        self.targets, self.num_outputs, self.names = targets, int(num_outputs), list(names)
        self.watch, self.mode = watch, mode

    @classmethod
    def schema(cls) -> type[TaskFacts]:
        """The schema that declares this task's facts (its kind, its metrics and their
        direction): the built-in one whose `_target_` is this class or the built-in class it
        extends; a class of yours of its own counts as task=custom."""
        paths = (f"{klass.__module__}.{klass.__qualname__}" for klass in cls.__mro__)
        return next(filter(None, map(schema_of_target, paths)), CustomTaskConfig)

    @property
    def kind(self) -> str:
        return self.schema().kind

    def check(self, output: tuple[int, ...] | None) -> None:
        """One line where this task cannot train a model whose output per sample is `output`
        (None: unknown) on its targets."""
        fit.check(self.kind, self.targets, output, self.num_outputs)

    def higher_is_better(self, metric: str) -> bool:
        """Which way `metric` (val/<name>) improves, as its schema says (dpt.config.tasks); a
        metric it cannot say of is a score, better higher."""
        found = higher_is_better(self.schema(), metric, self.watch, self.mode)
        return True if found is None else found

    def to(self, device: torch.device) -> Task:
        for value in vars(self).values():
            if isinstance(value, nn.Module):
                value.to(device)
        return self

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, which training backpropagates."""
        raise NotImplementedError

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Validation's loss: one per sample `(B,)`, or the batch's mean (a scalar, counted
        with the batch's size)."""
        return self.loss(outputs, targets)

    def sample_weights(self, targets: torch.Tensor) -> torch.Tensor | None:
        """What each sample's loss counts for in validation's mean: None, one each. A task
        whose samples hold different numbers of scored positions (a language model's answers)
        weighs each by them, so that the mean is per position."""
        return None

    def metrics(self) -> dict[str, Any]:
        """Fresh torchmetrics objects, by name (reported as val/<name>)."""
        return {}

    def named(self, *metrics: Any) -> dict[str, Any]:
        """`metrics` by the names the task's schema reports (after the loss), in its order (a
        trailing one may be left out: classification's acc5 below 5 classes)."""
        names = [name for name in self.schema().reports if name != LOSS]
        if len(metrics) > len(names):
            raise ValueError(f"{type(self).__name__} reports {names}: {len(metrics)} metrics")
        return dict(zip(names, metrics, strict=False))

    def update(
        self, metrics: Mapping[str, Any], outputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        for metric in metrics.values():
            metric.update(outputs, targets)

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """What `dpt-predict` reports of a batch of outputs, one row per sample `(B, n)`, in
        float32 (a bf16 output of autocast too)."""
        return outputs.reshape(len(outputs), -1).float()


def float_targets(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Targets as the loss compares them: at least float32 (a bf16 output under autocast is
    compared in float32, as autocast runs these losses), float64 for a float64 model."""
    return targets.to(torch.promote_types(outputs.dtype, torch.float32))


def compared(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and float targets as an elementwise loss takes them: the outputs in the targets'
    shape where only their layout differs ((B, 1) for (B,), (B, 8) for (B, 2, 4))."""
    if outputs.shape != targets.shape and outputs.numel() == targets.numel():
        outputs = outputs.reshape(targets.shape)
    return outputs, float_targets(outputs, targets)


def per_sample(values: torch.Tensor) -> torch.Tensor:
    """An elementwise loss as one mean per sample `(B,)`."""
    return values.reshape(len(values), -1).mean(dim=1)


def build_task(node: DictConfig, targets: Targets, num_outputs: int, names: list[str]) -> Task:
    """The run's task, for these targets and a model of `num_outputs` outputs per sample."""
    task = build_as(node, "task", targets=targets, num_outputs=num_outputs, names=names)
    if not isinstance(task, Task):
        raise DptError(
            f"task._target_={node._target_} built a {type(task).__name__}, not a dpt Task"
        )
    return task
