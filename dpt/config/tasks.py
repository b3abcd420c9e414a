"""`task`: what is learned (dpt/tasks), and the facts every task declares once, here, as class
variables of its schema (known without torch, before any process starts): its kind (the fit
rules of dpt/tasks/fit.py), the validation metrics it reports (`reports`, without `val/`) and
those of them that are better higher (`higher`). Everything else asks these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from dpt.config.checks import Check, above, between, checked, one_of

CLASSIFICATION, BINARY, MULTILABEL, REGRESSION, LANGUAGE_MODEL, CUSTOM = (
    "classification", "binary", "multilabel", "regression", "language_model", "custom"
)  # fmt: skip
WATCH_MODES = ("min", "max")  # which way a watched metric is better
PREDICT_OUTPUTS = ("values", "sigmoid", "softmax")
REGRESSION_LOSSES = ("mse", "l1", "huber")
LOSS = "loss"  # what every task reports (`val/loss`): better lower
_PROBABILITY = Check(lambda v: 0 < v < 1, "must be > 0 and < 1")  # task.threshold


class TaskFacts:
    """What a task's schema declares of the task (class variables, not config keys)."""

    kind: ClassVar[str] = CUSTOM
    reports: ClassVar[tuple[str, ...]] = ()  # its validation metrics, without `val/`
    higher: ClassVar[tuple[str, ...]] = ()  # those of them better higher


@dataclass
class ClassificationTaskConfig(TaskFacts):
    """One class per sample: logits (B, K), integer labels; cross-entropy."""

    _target_: str = "dpt.tasks.classification.Classification"
    kind: ClassVar[str] = CLASSIFICATION
    reports: ClassVar[tuple[str, ...]] = (LOSS, "acc1", "acc5")  # acc5 with 5 classes or more
    higher: ClassVar[tuple[str, ...]] = ("acc1", "acc5")
    label_smoothing: float = between(0, 1)  # training's cross-entropy only (val/loss is plain)
    watch: str = MISSING  # the metric model_best.pt, early stopping and sweep.objective=auto watch
    mode: str = one_of(WATCH_MODES)  # min or max: which way the watched metric is better


@dataclass
class BinaryTaskConfig(TaskFacts):
    """One logit per target column, 0/1 targets; binary cross-entropy on the logits."""

    _target_: str = "dpt.tasks.binary.Binary"
    kind: ClassVar[str] = BINARY
    reports: ClassVar[tuple[str, ...]] = (LOSS, "acc", "auroc", "f1")
    higher: ClassVar[tuple[str, ...]] = ("acc", "auroc", "f1")
    pos_weight: Any = MISSING  # null, a number, or one per target column: weight of positives
    # a probability above it predicts 1 (acc, f1, dpt-predict)
    threshold: float = checked(_PROBABILITY)
    watch: str = MISSING
    mode: str = one_of(WATCH_MODES)


@dataclass
class MultilabelTaskConfig(TaskFacts):
    """K labels per sample, any number of them present: logits (B, K), K-hot targets."""

    _target_: str = "dpt.tasks.multilabel.Multilabel"
    kind: ClassVar[str] = MULTILABEL
    reports: ClassVar[tuple[str, ...]] = (LOSS, "map", "f1")  # macro over the labels
    higher: ClassVar[tuple[str, ...]] = ("map", "f1")
    pos_weight: Any = MISSING
    threshold: float = checked(_PROBABILITY)
    watch: str = MISSING
    mode: str = one_of(WATCH_MODES)


@dataclass
class RegressionTaskConfig(TaskFacts):
    """Float targets of any shape; the output has as many numbers per sample."""

    _target_: str = "dpt.tasks.regression.Regression"
    kind: ClassVar[str] = REGRESSION
    reports: ClassVar[tuple[str, ...]] = (LOSS, "mse", "mae", "r2")
    higher: ClassVar[tuple[str, ...]] = ("r2",)
    loss: str = one_of(REGRESSION_LOSSES)  # mse, l1 or huber
    huber_delta: float = above(0)  # task.loss=huber: where it turns from squared to linear
    watch: str = MISSING
    mode: str = one_of(WATCH_MODES)


@dataclass
class LanguageModelTaskConfig(TaskFacts):
    """Next-token prediction: logits (B, T, V) for windows of token ids (B, T)."""

    _target_: str = "dpt.tasks.language_model.LanguageModel"
    kind: ClassVar[str] = LANGUAGE_MODEL
    reports: ClassVar[tuple[str, ...]] = (LOSS, "perplexity")
    watch: str = MISSING
    mode: str = one_of(WATCH_MODES)


@dataclass
class CustomTaskConfig(TaskFacts):
    """Your own loss and metrics, each a `_target_` node."""

    _target_: str = "dpt.tasks.custom.Custom"
    # The nodes below are built by the task (a loss function is not called at build time).
    _recursive_: bool = False
    kind: ClassVar[str] = CUSTOM
    reports: ClassVar[tuple[str, ...]] = (LOSS,)  # and the names of task.metrics
    # An nn.Module class (built with the node's other keys) or a function
    # (outputs, targets) -> scalar (its other keys bound as keyword arguments).
    loss: Any = MISSING
    # name -> a torchmetrics Metric `_target_` node: val/<name>, updated with (outputs, targets).
    metrics: dict[str, Any] = MISSING
    # What dpt-predict writes of an output: values (as the model gives them), sigmoid
    # (probabilities per output) or softmax (class probabilities).
    predict: str = one_of(PREDICT_OUTPUTS)
    watch: str = MISSING
    mode: str = one_of(WATCH_MODES)


# Each task's option (dpt/conf/task/<kind>.yaml) is named by its kind.
TASKS: dict[str, type[TaskFacts]] = {
    schema.kind: schema
    for schema in (ClassificationTaskConfig, BinaryTaskConfig, MultilabelTaskConfig,
                   RegressionTaskConfig, LanguageModelTaskConfig, CustomTaskConfig)
}  # fmt: skip
# The task a run made before the `task` group existed trained: task=classification's node, as
# its YAML sets it (a checkpoint's config and a run folder of then have no `task`).
BEFORE_TASKS: dict[str, Any] = {
    "_target_": ClassificationTaskConfig._target_,
    "label_smoothing": 0.0,
    "watch": "val/loss",
    "mode": "min",
}


def schema_of_target(target: str | None) -> type[TaskFacts] | None:
    """The built-in schema whose `_target_` is `target` (a task class's path); None for a task
    class of yours."""
    return next((s for s in TASKS.values() if s._target_ == target), None)  # type: ignore[attr-defined]


def task_schema(task: DictConfig) -> type[TaskFacts] | None:
    """The composed `task`'s schema: its own type, or (in a rank, whose config was rebuilt from
    plain values) the built-in schema of its `_target_`; None for a task class of yours."""
    schema = OmegaConf.get_type(task)
    if schema in TASKS.values():
        return schema  # type: ignore[return-value]
    return schema_of_target(task.get("_target_"))


def task_kind(task: DictConfig) -> str:
    """The composed `task`'s kind; a task class of yours counts as custom."""
    schema = task_schema(task)
    return CUSTOM if schema is None else schema.kind


def val_metrics(task: DictConfig) -> tuple[str, ...]:
    """The validation metrics `task` reports (`val/<name>`; `val/samples` is a count, left out)."""
    schema = task_schema(task) or CustomTaskConfig
    names = [*schema.reports, *((task.get("metrics") or {}) if schema.kind == CUSTOM else ())]
    return tuple(f"val/{name}" for name in names)


def higher_is_better(
    schema: type[TaskFacts] | None, metric: str, watch: str | None, mode: str | None
) -> bool | None:
    """Which way `metric` (val/<name>) improves: the loss down; a built-in task's metrics as
    its schema says (the watched one agrees: dpt.launch.validate); a custom task's watched
    metric as `mode` says; None for a custom task's other metrics (their class says:
    dpt.tasks.custom)."""
    name = metric.removeprefix("val/")
    if name == LOSS:
        return False
    if schema is not None and schema.kind != CUSTOM:
        return name in schema.higher
    if metric == watch:
        return mode == "max"
    return None


def task_higher_is_better(task: DictConfig, metric: str) -> bool | None:
    """`higher_is_better` of the composed `task`."""
    return higher_is_better(task_schema(task), metric, task.get("watch"), task.get("mode"))
