"""Whether a task fits the data set's targets and the model's output: the rules of the built-in
tasks, each refusal one line that names the task, the output's shape and the target's.

Torch-free: the launching process applies them to what a config declares (dpt's own data sets
and models) before any process starts, and to what it built of a user's (`dpt.launch.preflight`);
every rank applies them again to its built parts. The custom task has no rule here: its loss is
tried on tensors of the two shapes instead (`dpt.tasks.custom`).
"""

from __future__ import annotations

from dpt.config.tasks import BINARY, CLASSIFICATION, LANGUAGE_MODEL, MULTILABEL, REGRESSION
from dpt.errors import ConfigError
from dpt.targets import Targets, batch_shape


def num_outputs(task: str, targets: Targets, classes: int | None) -> int:
    """The model's outputs per sample: one per class for classification (per token of the
    vocabulary for a language model, at each position), else one per target number (a column,
    a label of a K-hot row, a regression value)."""
    if task in (CLASSIFICATION, LANGUAGE_MODEL):
        if classes is None:
            raise ConfigError(
                "task=classification needs the number of classes: the data set gives none "
                "(dataset.num_classes, or a `num_classes` attribute of your data module)"
            )
        return classes
    return targets.width


def check(task: str, targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    """Refuse, in one line, a task that cannot train on these targets with a model whose output
    per sample is `output` (None: not known, a model dpt built to give `outputs`)."""
    rule = RULES.get(task)
    if rule is not None:
        rule(targets, output, outputs)


def _classification(targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    if not targets.is_labels:
        _refuse(CLASSIFICATION, "integer class labels (B,)", targets,
                "use task=binary, task=multilabel or task=regression for such targets, or "
                "return int labels")  # fmt: skip
    if output is not None and output != (outputs,):
        raise ConfigError(
            f"task=classification: the model's output is {batch_shape(output)} for {outputs} "
            f"classes; it must be {batch_shape((outputs,))} (one logit per class)"
        )


def _binary(targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    if targets.is_labels and targets.classes is not None and targets.classes > 2:
        raise ConfigError(
            f"task=binary takes 0/1 targets: the data set has {targets.classes} classes; use "
            "task=classification"
        )
    if output is not None and not _fits(output, targets):
        raise ConfigError(
            f"task=binary takes one logit per target column: the model's output is "
            f"{batch_shape(output)}, the target {targets.text()}"
        )


def _multilabel(targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    if len(targets.shape) != 1:
        hint = "dataset=coco dataset.label_policy=all gives each image its category set"
        _refuse(MULTILABEL, "K-hot targets (B, K)", targets, hint)
    if output is not None and output != targets.shape:
        raise ConfigError(
            f"task=multilabel takes one logit per label: the model's output is "
            f"{batch_shape(output)}, the target {targets.text()}"
        )


def _regression(targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    if targets.integer:
        _refuse(REGRESSION, "float targets", targets,
                "return float tensors from the data set (torch.float32), or use "
                "task=classification")  # fmt: skip
    if output is not None and not _fits(output, targets):
        raise ConfigError(
            f"task=regression takes one output per target value: the model's output is "
            f"{batch_shape(output)}, the target {targets.text()}"
        )


def _language_model(targets: Targets, output: tuple[int, ...] | None, outputs: int) -> None:
    if not targets.integer or len(targets.shape) != 1:
        _refuse(LANGUAGE_MODEL, "token ids (B, T)", targets,
                "use dataset=text, or a data set of windows of token ids")  # fmt: skip
    if output is None:
        return
    steps = targets.shape[0]
    if len(output) != 2 or output[0] != steps:
        raise ConfigError(
            f"task=language_model takes logits (B, T, V) for token ids (B, T): the model's output "
            f"is {batch_shape(output)}, the target {targets.text()}"
        )
    if output[1] < outputs:
        raise ConfigError(
            f"task=language_model: the vocabulary has {outputs} tokens, more than the model's "
            f"{output[1]} outputs per position (model.vocab_size={output[1]}: raise it, or null "
            "for the data's)"
        )


def _fits(output: tuple[int, ...], targets: Targets) -> bool:
    """The same shape, or as many numbers per sample (the output is reshaped to the target's:
    `(B, 1)` for targets `(B,)`, `(B, 8)` for `(B, 2, 4)`)."""
    size = 1
    for n in output:
        size *= n
    return output == targets.shape or size == targets.width


def _refuse(task: str, takes: str, targets: Targets, hint: str) -> None:
    raise ConfigError(
        f"task={task} takes {takes}: the data set's targets are {targets.text()}; {hint}"
    )


RULES = {
    CLASSIFICATION: _classification,
    BINARY: _binary,
    MULTILABEL: _multilabel,
    REGRESSION: _regression,
    LANGUAGE_MODEL: _language_model,
}
