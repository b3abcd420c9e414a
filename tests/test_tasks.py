"""The task group in process: what a target is, the fit rules and their one-line refusals, each
task's loss and metrics against torch's and hand-made references, a loss and metric of one's own,
plain Dataset classes, what a model target is given, and the config the tasks compose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dpt.contract import model_kwargs
from dpt.errors import ConfigError, DptError
from dpt.launch.validate import validate
from dpt.state import resume_config
from dpt.targets import Targets
from dpt.tasks import fit
from dpt.tasks.task import Task, build_task
from tests.helpers import REPO, compose

EXAMPLE = REPO / "examples" / "tasks"
LABELS = Targets.labels(10)
COLUMN = Targets(integer=False, shape=(1,))


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example project's modules import as they do where dpt is started in its folder."""
    monkeypatch.syspath_prepend(str(EXAMPLE))


def _task(kind: str, targets: Targets, outputs: int, *overrides: str) -> Task:
    cfg = compose(f"task={kind}", *overrides)
    return build_task(cfg.task, targets, outputs, [str(i) for i in range(outputs)])


# --- what a target is -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "integer", "shape"),
    [
        (3, True, ()),
        (True, True, ()),
        (np.int64(2), True, ()),
        (0.5, False, ()),
        (torch.tensor(4), True, ()),
        (torch.tensor([1.0]), False, (1,)),
        (torch.zeros(3, dtype=torch.bool), True, (3,)),
        (np.zeros((2, 4)), False, (2, 4)),
    ],
)
def test_a_targets_kind_and_shape_come_from_one_sample(
    target: Any, integer: bool, shape: tuple[int, ...]
) -> None:
    found = Targets.of(target)
    assert (found.integer, found.shape) == (integer, shape)


def test_targets_stack_into_batches_and_empty_batches_keep_their_kind() -> None:
    labels = Targets.labels()
    assert torch.equal(labels.stack([1, torch.tensor(2)]), torch.tensor([1, 2]))
    assert labels.stack([1]).dtype == torch.long
    rows = COLUMN.stack([torch.tensor([0.5]), torch.tensor([1.0])])
    assert rows.shape == (2, 1) and rows.dtype == torch.float32
    assert COLUMN.empty().shape == (0, 1) and COLUMN.empty().dtype == torch.float32
    assert labels.empty().shape == (0,) and labels.empty().dtype == torch.long
    assert Targets(False, (-1,)).text() == "float (B, K)"


# --- the fit rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "targets", "output", "outputs", "message"),
    [
        ("binary", COLUMN, (10,), 1,
         "task=binary takes one logit per target column: the model's output is (B, 10), the "
         "target float (B, 1)"),
        ("binary", LABELS, None, 1,
         "task=binary takes 0/1 targets: the data set has 10 classes; use task=classification"),
        ("regression", LABELS, None, 1,
         "task=regression takes float targets: the data set's targets are integer class labels "
         "(B,); return float tensors from the data set (torch.float32), or use "
         "task=classification"),
        ("regression", Targets(False, (3,)), (2,), 3,
         "task=regression takes one output per target value: the model's output is (B, 2), the "
         "target float (B, 3)"),
        ("classification", COLUMN, None, 2,
         "task=classification takes integer class labels (B,): the data set's targets are float "
         "(B, 1); use task=binary, task=multilabel or task=regression for such targets, or "
         "return int labels"),
        ("classification", LABELS, (7,), 10,
         "task=classification: the model's output is (B, 7) for 10 classes; it must be (B, 10) "
         "(one logit per class)"),
        ("multilabel", LABELS, None, 1,
         "task=multilabel takes K-hot targets (B, K): the data set's targets are integer class "
         "labels (B,); dataset=coco dataset.label_policy=all gives each image its category set"),
        ("multilabel", Targets(False, (5,)), (4,), 5,
         "task=multilabel takes one logit per label: the model's output is (B, 4), the target "
         "float (B, 5)"),
    ],
)  # fmt: skip
def test_a_task_that_cannot_train_on_the_targets_and_output_is_one_line(
    kind: str, targets: Targets, output: tuple[int, ...] | None, outputs: int, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        fit.check(kind, targets, output, outputs)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("kind", "targets", "output"),
    [
        ("binary", COLUMN, (1,)),
        ("binary", Targets(False, ()), (1,)),  # (B, 1) logits for (B,) targets
        ("binary", Targets.labels(2), (1,)),
        ("regression", Targets(False, (2, 4)), (8,)),  # reshaped to the target's shape
        ("classification", LABELS, (10,)),
        ("multilabel", Targets(False, (5,)), (5,)),
        ("custom", LABELS, (3, 3)),  # custom: the loss is tried instead
    ],
)
def test_what_each_task_takes(kind: str, targets: Targets, output: tuple[int, ...]) -> None:
    fit.check(kind, targets, output, fit.num_outputs(kind, targets, targets.classes))


def test_the_model_gets_the_outputs_the_task_asks_for() -> None:
    assert fit.num_outputs("classification", LABELS, 10) == 10
    assert fit.num_outputs("binary", Targets(False, (3,)), None) == 3
    assert fit.num_outputs("regression", Targets(False, (2, 4)), None) == 8
    assert fit.num_outputs("binary", Targets(False, ()), None) == 1
    with pytest.raises(ConfigError, match="task=classification needs the number of classes"):
        fit.num_outputs("classification", Targets.labels(), None)


# --- each task's loss and metrics -----------------------------------------------------------------


def _metrics(task: Task, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    metrics = task.metrics()
    task.update(metrics, outputs, targets)
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def test_classification_is_cross_entropy_and_top_k_accuracy() -> None:
    task = _task("classification", LABELS, 10)
    outputs, targets = torch.randn(8, 10), torch.randint(0, 10, (8,))
    assert torch.equal(task.loss(outputs, targets), nn.CrossEntropyLoss()(outputs, targets))
    assert torch.equal(task.sample_losses(outputs, targets),
                       nn.functional.cross_entropy(outputs, targets, reduction="none"))  # fmt: skip
    found = _metrics(task, outputs, targets)
    top5 = outputs.topk(5, dim=1).indices
    assert found["acc1"] == pytest.approx(float((outputs.argmax(1) == targets).float().mean()))
    assert found["acc5"] == pytest.approx(float((top5 == targets[:, None]).any(1).float().mean()))
    assert list(_task("classification", Targets.labels(3), 3).metrics()) == ["acc1"]
    smoothed = _task("classification", LABELS, 10, "task.label_smoothing=0.1")
    assert torch.equal(smoothed.loss(outputs, targets),
                       nn.CrossEntropyLoss(label_smoothing=0.1)(outputs, targets))  # fmt: skip


def test_binary_is_bce_on_the_logits_with_accuracy_f1_and_auroc_at_the_threshold() -> None:
    task = _task("binary", COLUMN, 1, "task.threshold=0.7", "task.pos_weight=2.0")
    outputs = torch.tensor([[2.0], [0.5], [-1.0], [1.0], [-0.2], [0.9]])
    targets = torch.tensor([[1.0], [1.0], [0.0], [0.0], [1.0], [1.0]])
    expected = nn.functional.binary_cross_entropy_with_logits(
        outputs, targets, pos_weight=torch.tensor(2.0)
    )
    assert torch.allclose(task.loss(outputs, targets), expected)
    assert torch.allclose(task.sample_losses(outputs, targets).mean(), expected)
    # (B,) targets for (B, 1) logits: the same loss
    assert torch.allclose(task.loss(outputs, targets[:, 0]), expected)
    found = _metrics(task, outputs, targets)
    predicted = torch.sigmoid(outputs) > 0.7  # above the threshold: 2.0 and 0.9 (p = 0.71)
    truth = targets.bool()
    assert found["acc"] == pytest.approx(float((predicted == truth).float().mean()))
    tp = float((predicted & truth).sum())
    assert found["f1"] == pytest.approx(2 * tp / (float(predicted.sum()) + float(truth.sum())))
    assert found["auroc"] == pytest.approx(5 / 8)  # (positive, negative) pairs ranked right


def test_binary_metrics_take_logits_that_lie_in_zero_one_as_logits() -> None:
    """torchmetrics would read logits in [0, 1] as probabilities; the task gives it sigmoids."""
    task = _task("binary", COLUMN, 1)
    outputs = torch.tensor([[0.1], [0.9]])  # probabilities 0.52 and 0.71: both predict 1
    assert _metrics(task, outputs, torch.tensor([[1.0], [1.0]]))["acc"] == 1.0


def test_multilabel_map_averages_the_labels_that_occur() -> None:
    task = _task("multilabel", Targets(False, (3,)), 3)
    outputs = torch.tensor([[2.0, -1.0, 0.0], [-1.0, 1.0, 0.5], [1.0, -2.0, 0.1]])
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # label 2 absent
    found = _metrics(task, outputs, targets)
    assert found["map"] == pytest.approx(1.0)  # labels 0 and 1 ranked perfectly; 2 left out
    expected = nn.functional.binary_cross_entropy_with_logits(outputs, targets)
    assert torch.allclose(task.loss(outputs, targets), expected)
    predicted, truth = torch.sigmoid(outputs) > 0.5, targets.bool()  # logit 0: not above
    tp = float((predicted & truth).sum())
    assert found["f1"] == pytest.approx(2 * tp / (float(predicted.sum()) + float(truth.sum())))


@pytest.mark.parametrize(
    ("loss", "reference"),
    [("mse", nn.MSELoss()), ("l1", nn.L1Loss()), ("huber", nn.HuberLoss(delta=0.5))],
)
def test_regression_losses_and_mse_mae_r2(loss: str, reference: nn.Module) -> None:
    task = _task("regression", Targets(False, (2,)), 2, f"task.loss={loss}",
                 "task.huber_delta=0.5")  # fmt: skip
    outputs, targets = torch.randn(16, 2), torch.randn(16, 2)
    assert torch.allclose(task.loss(outputs, targets), reference(outputs, targets))
    found = _metrics(task, outputs, targets)
    assert found["mse"] == pytest.approx(float(((outputs - targets) ** 2).mean()), rel=1e-5)
    assert found["mae"] == pytest.approx(float((outputs - targets).abs().mean()), rel=1e-5)
    r2 = 1 - ((targets - outputs) ** 2).sum(0) / ((targets - targets.mean(0)) ** 2).sum(0)
    assert found["r2"] == pytest.approx(float(r2.mean()), rel=1e-5)  # per output, averaged


def test_regression_of_a_scalar_target_from_a_one_output_model() -> None:
    task = _task("regression", Targets(False, ()), 1)
    outputs, targets = torch.randn(16, 1), torch.randn(16)
    assert torch.allclose(task.loss(outputs, targets), nn.MSELoss()(outputs[:, 0], targets))
    r2 = 1 - ((targets - outputs[:, 0]) ** 2).sum() / ((targets - targets.mean()) ** 2).sum()
    assert _metrics(task, outputs, targets)["r2"] == pytest.approx(float(r2), rel=1e-5)


def test_loss_targets_follow_the_outputs_precision() -> None:
    task = _task("regression", Targets(False, ()), 1)
    double = task.loss(torch.randn(4, 1, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    assert double.dtype == torch.float64
    half = task.loss(torch.randn(4, 1).bfloat16(), torch.randn(4))
    assert half.dtype == torch.float32  # bf16 outputs compared in float32, as autocast does


# --- a loss and metrics of one's own --------------------------------------------------------------


def test_an_own_loss_function_with_its_keys_and_an_own_metric() -> None:
    from problems import BrierScore, focal_loss

    task = _task("focal", COLUMN, 1, "--config-dir", str(EXAMPLE / "conf"))
    outputs, targets = torch.randn(8, 1), (torch.rand(8, 1) > 0.5).float()
    assert torch.equal(task.loss(outputs, targets), focal_loss(outputs, targets, gamma=2.0))
    found = _metrics(task, outputs, targets)
    reference = BrierScore()
    reference.update(outputs, targets)
    assert found["brier"] == pytest.approx(float(reference.compute()))
    assert not task.higher_is_better("val/brier")  # watched, task.mode=min
    assert task.higher_is_better("val/acc")  # BinaryAccuracy's own higher_is_better
    assert torch.equal(task.predict(outputs), torch.sigmoid(outputs))  # task.predict=sigmoid
    task.check((1,))  # the loss and both metrics take (B, 1) outputs and targets


def test_an_own_loss_class_is_built_with_its_keys() -> None:
    task = _task(
        "custom", COLUMN, 1, "task.loss._target_=torch.nn.HuberLoss", "+task.loss.delta=0.5"
    )
    outputs, targets = torch.randn(8, 1), torch.randn(8, 1)
    assert torch.equal(task.loss(outputs, targets), nn.HuberLoss(delta=0.5)(outputs, targets))


@pytest.mark.parametrize(
    ("overrides", "output", "message"),
    [
        (["task.loss._target_=math.pi"], None,
         "task.loss._target_=math.pi is a float, which is not callable: name an nn.Module class "
         "or a function (outputs, targets) -> scalar"),
        (["task.loss._target_=collections.OrderedDict"], None,
         "task.loss._target_=collections.OrderedDict built a OrderedDict, which is not callable: "
         "name an nn.Module class or a function (outputs, targets) -> scalar"),
        (["task.loss._target_=torch.nn.CrossEntropyLoss"], (3,),
         "task=custom: task.loss (torch.nn.CrossEntropyLoss) cannot take the model's output "
         "(B, 3) and the target float (B, 1): RuntimeError: 0D or 1D target tensor expected, "
         "multi-target not supported"),
        (["task.loss._target_=torch.nn.functional.l1_loss", "+task.loss.reduction=none"], (1,),
         "task=custom: task.loss (torch.nn.functional.l1_loss) returned a tensor of shape (2, 1) "
         "for the model's output (B, 1) and the target float (B, 1), not a scalar (reduce it, "
         "e.g. .mean())"),
        (["task.loss._target_=torch.nn.MSELoss", "+task.metrics.m._target_=builtins.dict"], None,
         "task.metrics.m._target_=builtins.dict built a dict, not a torchmetrics Metric"),
        (["task.loss._target_=torch.nn.MSELoss",
          "+task.metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy",
          "+task.metrics.acc.num_classes=3"], (3,),
         "task=custom: task.metrics.acc (torchmetrics.classification.MulticlassAccuracy) cannot "
         "take the model's output (B, 3) and the target float (B, 1): ValueError: The `preds` "
         "and `target` should have the same shape, …"),
    ],
)  # fmt: skip
def test_an_own_loss_or_metric_that_cannot_work_is_one_line(
    overrides: list[str], output: tuple[int, ...] | None, message: str
) -> None:
    with pytest.raises(DptError) as caught:
        _task("custom", COLUMN, 1, *overrides).check(output)
    text = str(caught.value)
    assert "\n" not in text
    if message.endswith("…"):
        assert text.startswith(message[:-1]), text
    else:
        assert text == message


SCALAR = Targets(integer=False, shape=())  # one float per sample: a batch of (B,)


def squeezed_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss that meets a (B, 1) output and a (B,) target itself."""
    return nn.functional.mse_loss(outputs.squeeze(-1), targets)


def difference_squared(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()  # (B, 1) - (B,): (B, B), silently


@pytest.mark.parametrize("loss", ["torch.nn.MSELoss", f"{__name__}.difference_squared"])
def test_a_loss_that_broadcasts_a_column_against_the_targets_is_one_line(loss: str) -> None:
    """(B, 1) outputs against (B,) targets: the loss's value for them is not the loss of the
    same outputs in the targets' shape, so training would fit a B x B mix of every pair."""
    with pytest.raises(DptError) as caught:
        _task("custom", SCALAR, 1, f"task.loss._target_={loss}").check((1,))
    assert str(caught.value) == (
        f"task=custom: task.loss ({loss}) broadcasts the model's output (B, 1) against the target "
        "float (B,) (to (B, B) or wider): it gives another value for the same outputs in the "
        "target's shape; reshape them in the loss (outputs.view_as(targets)) or in the model's "
        "forward (to (B,))"
    )


@pytest.mark.parametrize(
    ("loss", "targets", "output"),
    [
        (f"{__name__}.squeezed_mse", SCALAR, (1,)),  # minds the layout itself
        ("torch.nn.MSELoss", COLUMN, (1,)),  # the same shape: nothing to broadcast
        ("torch.nn.CrossEntropyLoss", LABELS, (10,)),  # labels and logits: not one layout
    ],
)
def test_a_loss_that_meets_outputs_and_targets_as_they_are_passes(
    loss: str, targets: Targets, output: tuple[int, ...]
) -> None:
    _task("custom", targets, output[0], f"task.loss._target_={loss}").check(output)


# --- plain Dataset classes and what a model target gets -------------------------------------------


def test_plain_dataset_classes_with_their_own_keys() -> None:
    from dpt.loop.parts import build_data, build_data_task

    cfg = compose("--config-dir", str(EXAMPLE / "conf"), "dataset=line", "task=regression")
    data, shuffle = build_data(cfg.dataset, seed=3)
    assert shuffle and data.input_shape == (4,) and len(data.train) == 2048
    assert data.target_spec == Targets(False, ())
    assert not torch.equal(data.train[0][0], data.val[0][0])  # part 0 and part 1: two draws
    task = build_data_task(cfg.task, data)
    assert (task.kind, task.num_outputs, task.names) == ("regression", 1, ["0"])
    tags = build_data(compose("--config-dir", str(EXAMPLE / "conf"), "dataset=tags").dataset, 0)[0]
    assert tags.classes == ["red", "green", "blue", "round", "large"]
    assert tags.target_spec == Targets(False, (5,))


class Singles(torch.utils.data.Dataset):
    """A data set whose items are inputs alone, no targets."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(3)


@pytest.mark.parametrize(
    ("size", "message"),
    [(0, "dataset.train: the data set is empty"),
     (4, "dataset.train: item 0 is a Tensor, not an (input, target) pair")],
)  # fmt: skip
def test_a_dataset_without_an_input_target_pair_is_one_line(size: int, message: str) -> None:
    from dpt.loop.parts import build_data

    cfg = compose("dataset=custom", f"+dataset.train._target_={__name__}.Singles",
                  f"+dataset.train.size={size}")  # fmt: skip
    with pytest.raises(DptError) as caught:
        build_data(cfg.dataset, seed=0)
    assert str(caught.value) == message


def test_a_model_target_gets_only_the_keywords_its_signature_names() -> None:
    from simple import SimpleNet

    assert model_kwargs(SimpleNet, (10,), 1) == {}

    def net(input_dim: int, num_outputs: int) -> nn.Module:
        return nn.Linear(input_dim, num_outputs)

    assert model_kwargs(net, (10,), 3) == {"num_outputs": 3}


# --- the config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "watch", "mode", "reports"),
    [
        ("classification", "val/loss", "min", ("val/loss", "val/acc1", "val/acc5")),
        ("binary", "val/loss", "min", ("val/loss", "val/acc", "val/auroc", "val/f1")),
        ("multilabel", "val/map", "max", ("val/loss", "val/map", "val/f1")),
        ("regression", "val/loss", "min", ("val/loss", "val/mse", "val/mae", "val/r2")),
    ],
)
def test_each_task_sets_what_is_watched(
    kind: str, watch: str, mode: str, reports: tuple[str, ...]
) -> None:
    from dpt.config.tasks import val_metrics
    from dpt.tasks import objective

    cfg = compose(f"task={kind}")
    es = cfg.trainer.early_stopping
    assert (es.metric, es.mode) == (watch, mode)  # best model and early stopping follow
    assert val_metrics(cfg.task) == reports
    found = objective.of_config(cfg)
    assert (found.name, found.direction) == (watch, "maximize" if mode == "max" else "minimize")
    assert objective.of_config(compose(f"task={kind}", f"sweep.objective={reports[1]}")).direction \
        == ("minimize" if reports[1] in ("val/mse", "val/mae") else "maximize")  # fmt: skip


@pytest.mark.parametrize(
    ("objective", "direction"),
    [("auto", "minimize"), ("val/brier", "minimize"), ("val/acc", "maximize")],
)
def test_a_search_optimizes_an_own_metric_the_way_its_class_says(
    objective: str, direction: str
) -> None:
    """val/brier is watched (task.mode=min); val/acc is not, and BinaryAccuracy says it is
    better higher: the sweeper's direction, known before any trial runs."""
    from dpt.tasks import objective as objectives

    cfg = compose("--config-dir", str(EXAMPLE / "conf"), "model=simple_net", "dataset=random",
                  "task=focal", f"sweep.objective={objective}")  # fmt: skip
    found = objectives.of_config(cfg)
    assert (found.name, found.direction) == (
        "val/brier" if objective == "auto" else objective,
        direction,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=regression", "task.watch=val/acc1"],
         "task.watch=val/acc1: must be one of val/loss, val/mse, val/mae, val/r2"),
        (["task=multilabel", "task.mode=min"], "task.mode=min: val/map is better higher; set "
         "task.mode=max"),
        (["task=binary", "task.threshold=1.5"], "task.threshold=1.5: must be > 0 and < 1"),
        (["task=binary", "task.pos_weight=[1,-2]"], "task.pos_weight=[1, -2]: must be null, a "
         "number > 0, or a list of numbers > 0 (one per target column)"),
        (["task=regression", "task.loss=l3"], "task.loss=l3: must be one of mse, l1, huber"),
        (["task=regression", "dataset=custom", "+dataset.train._target_=problems.LinePoints",
          "trainer.early_stopping.metric=val/acc1"],
         "trainer.early_stopping.metric=val/acc1: must be one of val/loss, val/mse, val/mae, "
         "val/r2"),
        (["task=multilabel"], "task=multilabel takes K-hot targets (B, K): the data set's targets "
         "are integer class labels (B,); dataset=coco dataset.label_policy=all gives each image "
         "its category set"),
        (["task=custom", "task.loss._target_=torch.nn.MSELoss", "+task.metrics.acc=3"],
         "task.metrics.acc=3: must be a node with a _target_ (a Metric class) and its keys"),
        (["task=custom", "task.loss._target_=my_losses_xyz.Focal"],
         "task.loss._target_=my_losses_xyz.Focal: cannot import my_losses_xyz; dpt imports your "
         "code from the folder it was started in and from PYTHONPATH "
         "(docs/guides/own-model-and-data.md)"),
        (["dataset=custom", "+dataset.train._target_=torch.nn.Linear"],
         "dataset.num_classes=null: task=classification needs the number of classes (labels 0 "
         ".. N-1)"),
    ],
)  # fmt: skip
def test_task_settings_are_checked_before_anything_starts(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(compose(*overrides))
    assert str(caught.value) == message


def test_a_checkpoint_of_before_tasks_resumes_as_classification() -> None:
    now = compose()
    stored = OmegaConf.to_container(now, resolve=True)
    assert isinstance(stored, dict)
    del stored["task"]  # what a checkpoint's config held before tasks
    before = resume_config.flat(OmegaConf.to_yaml(OmegaConf.create(stored)))
    current = resume_config.flat(OmegaConf.to_yaml(now))
    assert resume_config.compare(before, current).refused == ()
    other = resume_config.flat(OmegaConf.to_yaml(compose("task=binary")))
    refused = resume_config.compare(current, other).refused
    assert refused and resume_config.reason(refused[0].key) == (
        "that changes what is learned and how it is measured"
    )


# --- the monitor names where a non-finite loss came from ------------------------------------------


class NanTargets(torch.utils.data.Dataset):
    """Points with float targets; the target of sample `bad` is NaN."""

    def __init__(self, n_samples: int, bad: int) -> None:
        self.x = torch.randn(n_samples, 3, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1)
        self.y[bad] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def log_of_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss of one's own that is never finite: the log of negative numbers."""
    return torch.log(-outputs.abs() - 1).mean() + 0 * targets.mean()


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        (["task=regression", "+dataset.train.bad=5"],
         "its targets are not finite: the data set gave them"),
        (["task=custom", f"task.loss._target_={__name__}.log_of_outputs", "+dataset.train.bad=63"],
         "its forward is finite, the loss of task=custom is not"),
    ],
)  # fmt: skip
def test_a_non_finite_loss_from_the_targets_or_the_loss_is_said_so(
    tmp_path: Path, overrides: list[str], where: str
) -> None:
    """Replayed at the step itself (on_nonfinite=skip), the forward is finite: the event says
    whether the targets or the task's loss made the loss non-finite."""
    from dpt.distributed import env_from_environment
    from dpt.monitor.events import read_events
    from tests.helpers import build_trainer, one_thread

    cfg = ["dataset=custom", f"+dataset.train._target_={__name__}.NanTargets",
           "+dataset.train.n_samples=64", "dataset.shuffle=false", "trainer.batch_size=8",
           "trainer.max_steps=2", "trainer.on_nonfinite=skip", "checkpoint.enabled=false",
           "model.hidden_dims=[4]"]  # fmt: skip
    with one_thread():
        trainer = build_trainer(tmp_path, env_from_environment("cpu"), *cfg, *overrides)
        trainer.fit()
        trainer.metrics.close()
    events = [e for e in read_events(tmp_path) if e["detector"] == "nonfinite"]
    assert (events[0]["step"], events[0]["action"], events[0]["note"]) == (1, "skip", where)
