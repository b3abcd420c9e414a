"""What `dpt-predict` prints and writes of each prediction, as the run's task reads.

`layout(predictor)` gives the task's `Layout`: the cells of a printed line after the path, and
the CSV's columns with a row's cells; `format_line` prints a line, `csv_rows` writes the CSV,
`Tally` and `summary` make the last line (the accuracy, the unreadable images skipped). The
module docstring of dpt/commands/predict.py says what each task prints and writes.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dpt.config.tasks import BINARY, CLASSIFICATION, MULTILABEL
from dpt.errors import DptError, could_not_write

if TYPE_CHECKING:
    import torch

    from dpt.commands.run_model import Predictor

# The name every data set gives a lone output it does not name.
UNNAMED = "0"


@dataclass
class Prediction:
    path: Path  # the image file, or the tensor file that holds the input
    probabilities: torch.Tensor  # (n,): what the task predicts (class probabilities, ...)
    row: int | None = None  # the input's row in a tensor file

    @property
    def name(self) -> str:
        """`data/val/cat/001.jpg`, or `inputs.pt:3` for a tensor file's row 3."""
        return str(self.path) if self.row is None else f"{self.path}:{self.row}"


@dataclass
class Tally:
    """What the summary line reports."""

    predicted: int = 0
    unreadable: int = 0
    correct: int = 0
    labelled: bool = True  # every predicted image lies in a folder named after a class


def count(prediction: Prediction, classes: list[str], tally: Tally) -> None:
    """Score a prediction against its folder's name, while every folder so far is a class (a
    tensor file's row has no label)."""
    tally.predicted += 1
    folder = prediction.path.parent.name
    if prediction.row is not None or folder not in classes:
        tally.labelled = False
    elif tally.labelled:
        tally.correct += classes[int(prediction.probabilities.argmax())] == folder


@dataclass
class Layout:
    """How one task's predictions read: the cells of a printed line after the path, and the
    CSV's columns after `path` (`header`) with a row's cells (`row`)."""

    header: list[str]
    line: Callable[[Prediction], str]
    row: Callable[[Prediction], list[str]]
    widths: list[int] = field(default_factory=list)


def layout(predictor: Predictor, top_k: int = 3) -> Layout:
    """The layout of the run's task (dpt/commands/predict.py's module docstring says each)."""
    names, kind = predictor.classes, predictor.kind
    threshold = float(getattr(predictor.task, "threshold", 0.5))
    if kind == CLASSIFICATION:
        return _classification(names, top_k)
    if kind == BINARY:
        return _binary(names, threshold)
    if kind == MULTILABEL:
        return _multilabel(names, threshold)
    return _values(names)


def _checked(prediction: Prediction, names: list[str]) -> list[float]:
    values = [float(v) for v in prediction.probabilities.reshape(-1)]
    if len(values) != len(names):
        raise DptError(
            f"the run's task predicts {len(values)} numbers per input, but data.json names "
            f"{len(names)} outputs ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
        )
    return values


def _lone(names: list[str], instead: str) -> list[str]:
    """The CSV's columns for the outputs: `instead` for one output the data set did not name."""
    return [instead] if names == [UNNAMED] else list(names)


def _named_cells(pairs: list[tuple[str, float]], width: int) -> str:
    return "  ".join(f"{name:<{width}} {value:.3f}" for name, value in pairs)


def _classification(names: list[str], top_k: int) -> Layout:
    width = max((len(c) for c in names), default=0)

    def line(prediction: Prediction) -> str:
        values, indices = prediction.probabilities.topk(top_k)
        pairs = [(names[int(i)], float(p)) for p, i in zip(values, indices, strict=True)]
        return _named_cells(pairs, width)

    def row(prediction: Prediction) -> list[str]:
        p, i = prediction.probabilities.max(dim=0)
        return [names[int(i)], f"{float(p):.6f}"]

    return Layout(["class", "probability"], line, row)


def above(prediction: Prediction, threshold: float) -> list[bool]:
    """Whether each probability predicts yes: strictly above the threshold, compared in the
    probabilities' float32 as validation's accuracy and F1 count it (torchmetrics' binary
    metrics: `preds > threshold`)."""
    return [bool(yes) for yes in (prediction.probabilities.reshape(-1) > threshold).tolist()]


def _binary(names: list[str], threshold: float) -> Layout:
    width = max((len(c) for c in names), default=0)

    def line(prediction: Prediction) -> str:
        values = _checked(prediction, names)
        if len(values) == 1:
            return f"{values[0]:.3f}  {int(above(prediction, threshold)[0])}"
        return _named_cells(list(zip(names, values, strict=True)), width)

    def row(prediction: Prediction) -> list[str]:
        values = _checked(prediction, names)
        yes = above(prediction, threshold)
        if len(values) == 1:
            predicted = str(int(yes[0]))
        else:
            predicted = ";".join(n for n, chosen in zip(names, yes, strict=True) if chosen)
        return [*(f"{v:.6f}" for v in values), predicted]

    return Layout([*_lone(names, "probability"), "predicted"], line, row)


def _multilabel(names: list[str], threshold: float) -> Layout:
    width = max((len(c) for c in names), default=0)

    def picked(prediction: Prediction) -> list[tuple[str, float]]:
        """The labels above the threshold, highest probability first."""
        values, yes = _checked(prediction, names), above(prediction, threshold)
        chosen = sorted((-v, i) for i, v in enumerate(values) if yes[i])
        return [(names[i], -v) for v, i in chosen]

    def line(prediction: Prediction) -> str:
        return _named_cells(picked(prediction), width) or "-"

    def row(prediction: Prediction) -> list[str]:
        labels = picked(prediction)
        return [";".join(n for n, _ in labels), ";".join(f"{v:.6f}" for _, v in labels)]

    return Layout(["labels", "probabilities"], line, row)


def _values(names: list[str]) -> Layout:
    def line(prediction: Prediction) -> str:
        return "  ".join(f"{v:<12.6g}" for v in _checked(prediction, names))

    def row(prediction: Prediction) -> list[str]:
        return [repr(v) for v in _checked(prediction, names)]

    return Layout(_lone(names, "value"), line, row)


def format_line(prediction: Prediction, shape: Layout, path_width: int) -> str:
    """`data/val/cat/001.jpg  cat 0.912  dog 0.071  bird 0.017`, aligned in columns."""
    return f"{prediction.name:<{path_width}}  {shape.line(prediction)}".rstrip()


def summary(tally: Tally) -> str | None:
    skipped = (
        f"{tally.unreadable} unreadable image{'s' if tally.unreadable != 1 else ''} skipped"
        if tally.unreadable
        else ""
    )
    if tally.labelled and tally.predicted:
        accuracy = (
            f"accuracy {tally.correct / tally.predicted:.4f} on {tally.predicted} "
            f"image{'s' if tally.predicted != 1 else ''} (labels from their folder names)"
        )
        return f"{accuracy}; {skipped}" if skipped else accuracy
    return skipped or None


@contextlib.contextmanager
def csv_rows(path: str | None, shape: Layout) -> Iterator[Callable[[Prediction], None]]:
    """A writer of `path,<the task's columns>` rows into `path`; one that writes nothing where
    no file was asked for. Only the file's own errors become "could not write" (not, say, a
    closed stdout)."""
    if path is None:
        yield lambda prediction: None
        return
    with _writing(path):
        f = open(path, "w", newline="")  # noqa: SIM115  (closed below, its errors reported)
        rows = csv.writer(f)
        rows.writerow(["path", *shape.header])

    def write(prediction: Prediction) -> None:
        cells = shape.row(prediction)
        with _writing(path):
            rows.writerow([prediction.name, *cells])

    try:
        yield write
    finally:
        with _writing(path):
            f.close()


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:  # e.g. a full disk
        raise DptError(could_not_write(path, error)) from error
