"""`task=custom`: your own loss (`task.loss._target_`: an `nn.Module` class or a function
`(outputs, targets) -> scalar`) and metrics (`task.metrics`: name -> a torchmetrics `Metric`
`_target_`), watched by `task.watch` in `task.mode`. Outputs and targets reach both as the model
and the data set give them."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dpt.config.build import build_as
from dpt.errors import DptError, one_line
from dpt.targets import Targets, batch_shape
from dpt.tasks.task import Task
from dpt.user_code import locate

LOSS_KEY = "task.loss._target_"
# Outputs and targets of this many samples, zeros, try the loss and metrics before training.
TRIAL_BATCH = 2
# Random outputs and targets of this many samples: does the loss broadcast them? (A batch of 2
# could, by chance, give the same loss both ways; 8 does not.)
LAYOUT_BATCH = 8


class Custom(Task):
    def __init__(self, loss: DictConfig, metrics: DictConfig, predict: str, **common: Any) -> None:
        super().__init__(**common)
        self.loss_name = str(loss.get("_target_"))
        self.criterion = build_loss(loss)
        self.metric_nodes: dict[str, DictConfig] = {str(k): v for k, v in metrics.items()}
        self.output = predict
        self.metrics()  # a metric that cannot be built says so now, not at the first validation

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs, targets)

    def metrics(self) -> dict[str, Any]:
        return {name: build_metric(name, node) for name, node in self.metric_nodes.items()}

    def higher_is_better(self, metric: str) -> bool:
        """The watched metric as `task.mode` says; another as its class says (torchmetrics'
        `higher_is_better`; a class that says nothing counts as a score, better higher)."""
        name = metric.removeprefix("val/")
        if name == "loss" or metric == self.watch or name not in self.metric_nodes:
            return super().higher_is_better(metric)
        return metric_direction(name, self.metric_nodes[name]) is not False

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        rows = super().predict(outputs)
        if self.output == "sigmoid":
            return torch.sigmoid(rows)
        return torch.softmax(rows, dim=1) if self.output == "softmax" else rows

    def check(self, output: tuple[int, ...] | None) -> None:
        """The loss and every metric tried on zeros of the model's output shape and the
        targets' (no rule can say what your loss takes): one line where one cannot take them."""
        if output is None:
            return
        outputs = torch.zeros(TRIAL_BATCH, *output)
        dtype = torch.long if self.targets.integer else torch.float32
        targets = torch.zeros(TRIAL_BATCH, *self.targets.shape, dtype=dtype)
        shapes = f"the model's output {batch_shape(output)} and the target {self.targets.text()}"
        with warnings.catch_warnings():  # e.g. MSELoss's of broadcasting: said in one line below
            warnings.simplefilter("ignore")
            value = _tried(
                f"task.loss ({self.loss_name})", shapes, self.criterion, outputs, targets
            )
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise DptError(
                f"task=custom: task.loss ({self.loss_name}) returned "
                f"{_described(value)} for {shapes}, not a scalar (reduce it, e.g. .mean())"
            )
        self._check_layouts(output)
        for name, metric in self.metrics().items():
            target = self.metric_nodes[name].get("_target_")
            _tried(f"task.metrics.{name} ({target})", shapes, metric.update, outputs, targets)

    def _check_layouts(self, output: tuple[int, ...]) -> None:
        """Outputs and targets of as many numbers laid out apart, (B, 1) and (B,): a loss that
        meets them elementwise broadcasts them to (B, B) and trains on nonsense, without an
        error (MSELoss only warns). Asked of the loss itself, on random values: the outputs as
        the model gives them, and the same outputs in the targets' shape. Where both give a loss
        and the two differ, the loss broadcasts: refused. A loss that minds the layout itself
        (it squeezes) fails on one of the two, and is left alone."""
        target = self.targets.shape
        if output == target or math.prod(output) != math.prod(target):
            return
        generator = torch.Generator().manual_seed(0)
        outputs = torch.randn(LAYOUT_BATCH, *output, generator=generator)
        targets = _random_targets(self.targets, LAYOUT_BATCH, generator)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                given = self.criterion(outputs, targets)
                reshaped = self.criterion(outputs.reshape(targets.shape), targets)
        except Exception:  # one of the layouts is not this loss's: it minds them itself
            return
        same = torch.is_tensor(given) and torch.is_tensor(reshaped)
        if (
            same
            and given.shape == reshaped.shape
            and torch.allclose(given, reshaped, equal_nan=True)
        ):
            return
        raise DptError(
            f"task=custom: task.loss ({self.loss_name}) broadcasts the model's output "
            f"{batch_shape(output)} against the target {self.targets.text()} (to (B, B) or "
            "wider): it gives another value for the same outputs in the target's shape; "
            "reshape them in the loss (outputs.view_as(targets)) or in the model's forward "
            f"(to {batch_shape(target)})"
        )


def _random_targets(spec: Targets, batch: int, generator: torch.Generator) -> torch.Tensor:
    if spec.integer:
        high = spec.classes or 2
        return torch.randint(0, high, (batch, *spec.shape), generator=generator)
    return torch.rand((batch, *spec.shape), generator=generator)


def _tried(what: str, shapes: str, call: Callable[..., Any], *args: torch.Tensor) -> Any:
    try:
        return call(*args)
    except Exception as error:  # whatever the user's code raises: said in one line
        raise DptError(
            f"task=custom: {what} cannot take {shapes}: {type(error).__name__}: {one_line(error)}"
        ) from error


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def build_loss(node: DictConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss class built with the node's keys, or a loss function with them bound."""
    target = locate(str(node.get("_target_")), LOSS_KEY)
    keys = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
    if isinstance(target, type):
        loss = build_as(node, "task.loss")
    elif callable(target):
        loss = functools.partial(target, **keys) if keys else target
    else:
        loss = target
    if not callable(loss):
        built = "is" if loss is target else "built"
        raise DptError(
            f"{LOSS_KEY}={node._target_} {built} a {type(loss).__name__}, which is not callable: "
            "name an nn.Module class or a function (outputs, targets) -> scalar"
        )
    return loss


def build_metric(name: str, node: DictConfig) -> Any:
    from torchmetrics import Metric

    metric = build_as(node, f"task.metrics.{name}")
    if not isinstance(metric, Metric):
        raise DptError(
            f"task.metrics.{name}._target_={node._target_} built a {type(metric).__name__}, "
            "not a torchmetrics Metric"
        )
    return metric


def metric_direction(name: str, node: DictConfig) -> bool | None:
    """A metric class's own word on which way it improves (`higher_is_better`), or None."""
    found = locate(str(node.get("_target_")), f"task.metrics.{name}._target_")
    direction = getattr(found, "higher_is_better", None)
    return direction if isinstance(direction, bool) else None
