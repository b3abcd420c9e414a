"""What `dpt-evaluate` keeps of one pass over a split beyond the task's metrics, and how it shows
it: a classification's per-class precision, recall and F1 and its confusion matrix, a
regression's predicted-against-true scatter plot; the PNG files, the TensorBoard image, the
console's table.

Each `Extra` sees every batch validation's `evaluate` counts (its `on_batch`), so its numbers
are over exactly the samples the metrics are. torch and matplotlib are imported inside the
functions: `dpt-evaluate --help` answers before they load.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt.config.tasks import CLASSIFICATION, REGRESSION

if TYPE_CHECKING:
    import torch

    from dpt.tasks.task import Task

# Counts are written in the cells up to this many classes; more would not be readable.
MAX_ANNOTATED = 30
# The figure grows with the classes up to this many inches a side.
MAX_INCHES = 24.0


@dataclass
class Plot:
    """One PNG of the evaluation: its name's stem (`confusion`, `scatter`) and its bytes."""

    name: str
    png: bytes


@dataclass
class Extra:
    """What a task's evaluation adds to the metrics (none by default): a JSON part, a console
    part and plots."""

    report: dict[str, Any] = field(default_factory=dict)  # merged into eval-<split>.json
    lines: list[str] = field(default_factory=list)  # printed after the metrics
    plots: list[Plot] = field(default_factory=list)


class Collector:
    """Sees each batch's outputs and targets; `finish` makes the `Extra`. This one keeps
    nothing: the tasks without a table or a plot (binary, multilabel, language model, custom)."""

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        del outputs, targets

    def finish(self, split: str) -> Extra:
        del split
        return Extra()


def collector_for(task: Task, device: torch.device) -> Collector:
    """The run's task's collector: per class for classification, a scatter for regression."""
    if task.kind == CLASSIFICATION:
        return ClassTable(task.names, device)
    if task.kind == REGRESSION:
        return Scatter(task)
    return Collector()


# --- classification -------------------------------------------------------------------------------


class ClassTable(Collector):
    """Per-class precision, recall and F1 (torchmetrics, average=None) and the confusion
    matrix (rows: the true class, columns: the predicted one)."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        from torchmetrics import MetricCollection
        from torchmetrics.classification import (
            MulticlassConfusionMatrix,
            MulticlassF1Score,
            MulticlassPrecision,
            MulticlassRecall,
        )

        self.names = names
        k = len(names)
        self.metrics = MetricCollection({
            "precision": MulticlassPrecision(num_classes=k, average=None),
            "recall": MulticlassRecall(num_classes=k, average=None),
            "f1": MulticlassF1Score(num_classes=k, average=None),
            "confusion": MulticlassConfusionMatrix(num_classes=k),
        }, compute_groups=False).to(device)  # fmt: skip

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.metrics.update(outputs, targets)

    def finish(self, split: str) -> Extra:
        values = {name: value.cpu() for name, value in self.metrics.compute().items()}
        counts = [[int(n) for n in row] for row in values["confusion"].tolist()]
        rows = [
            {"class": name, "precision": float(values["precision"][i]),
             "recall": float(values["recall"][i]), "f1": float(values["f1"][i]),
             "support": sum(counts[i])}
            for i, name in enumerate(self.names)
        ]  # fmt: skip
        report = {
            "per_class": rows,
            "confusion": {"rows": "true class", "columns": "predicted class",
                          "classes": self.names, "counts": counts},
        }  # fmt: skip
        plot = Plot("confusion", confusion_png(counts, self.names, split))
        return Extra(report, class_lines(rows), [plot])


def class_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The per-class table, a class a line, its columns aligned."""
    width = max(len("class"), *(len(str(row["class"])) for row in rows))
    head = f"{'class':<{width}}  precision  recall  f1      support"
    lines = [head]
    for row in rows:
        lines.append(f"{row['class']:<{width}}  {row['precision']:<9.4f}  {row['recall']:<6.4f}  "
                     f"{row['f1']:<6.4f}  {row['support']}")  # fmt: skip
    return lines


def confusion_png(counts: list[list[int]], names: list[str], split: str) -> bytes:
    """The confusion matrix as a PNG: the counts in the cells, the class names on the axes."""
    from matplotlib.figure import Figure

    k = len(names)
    side = min(MAX_INCHES, max(4.0, 0.6 * k + 2))
    fig = Figure(figsize=(side, side), dpi=100)
    ax = fig.subplots()
    ax.imshow(counts, cmap="Blues")
    ax.set_xticks(range(k), names, rotation=90 if k > 8 else 0)
    ax.set_yticks(range(k), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"confusion matrix ({split})")
    if k <= MAX_ANNOTATED:
        top = max(max(row) for row in counts) or 1
        for i, row in enumerate(counts):
            for j, n in enumerate(row):
                ax.text(j, i, str(n), ha="center", va="center",
                        color="white" if n > top / 2 else "black")  # fmt: skip
    fig.tight_layout()
    return _png(fig)


# --- regression -----------------------------------------------------------------------------------


class Scatter(Collector):
    """Every predicted value against its true one, for a scatter plot (one colour an output)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.predicted: list[torch.Tensor] = []
        self.true: list[torch.Tensor] = []

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        from dpt.tasks.task import float_targets

        rows = self.task.predict(outputs).float().cpu()  # (B, n): what regression's metrics see
        self.predicted.append(rows)
        self.true.append(float_targets(outputs, targets).reshape(rows.shape).float().cpu())

    def finish(self, split: str) -> Extra:
        import torch

        if not self.predicted:
            return Extra()
        predicted, true = torch.cat(self.predicted), torch.cat(self.true)
        names = self.task.names or [str(i) for i in range(predicted.shape[1])]
        return Extra(plots=[Plot("scatter", scatter_png(predicted, true, names, split))])


def scatter_png(predicted: torch.Tensor, true: torch.Tensor, names: list[str], split: str) -> bytes:
    """Predicted against true values, an output a colour, with the line where they are equal."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 5), dpi=100)
    ax = fig.subplots()
    for column in range(predicted.shape[1]):
        label = names[column] if column < len(names) else str(column)
        ax.scatter(true[:, column], predicted[:, column], s=8, alpha=0.6, label=label)
    low = float(min(true.min(), predicted.min()))
    high = float(max(true.max(), predicted.max()))
    ax.plot([low, high], [low, high], color="grey", linewidth=1)  # predicted = true
    ax.set_xlabel("true value")
    ax.set_ylabel("predicted value")
    ax.set_title(f"predicted against true ({split})")
    if predicted.shape[1] > 1:
        ax.legend()
    fig.tight_layout()
    return _png(fig)


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")  # a Figure of its own: Agg, no pyplot state
    return buffer.getvalue()


# --- TensorBoard ----------------------------------------------------------------------------------


def tensorboard_images(folder: Path, plots: list[Plot], split: str, step: int) -> None:
    """The plots as images (`<split>/<name>`) in a new event file of `folder` (the run's world
    folder): TensorBoard's Images tab shows them beside the run's curves."""
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    from dpt.observe.event_file import EventFile, summary_event

    values = []
    for plot in plots:
        width, height = Image.open(io.BytesIO(plot.png)).size
        image = Summary.Image(height=height, width=width, colorspace=4,  # RGBA
                              encoded_image_string=plot.png)  # fmt: skip
        values.append(Summary.Value(tag=f"{split}/{plot.name}", image=image))
    events = EventFile(folder)
    try:
        events.write([summary_event(Summary(value=values), step)])
    finally:
        events.close()
