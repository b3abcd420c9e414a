"""`task=multilabel`: any number of K labels per sample. Logits (B, K) against K-hot targets,
binary cross-entropy per label; validation's macro mean average precision (over the labels that
occur in the validation set) and F1 at `task.threshold` over every (sample, label)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from dpt.tasks.binary import Logits


class Multilabel(Logits):
    def metrics(self) -> dict[str, Any]:
        from torchmetrics.classification import BinaryF1Score

        return self.named(present_labels_ap()(num_labels=self.num_outputs),
                          BinaryF1Score(threshold=self.threshold))  # fmt: skip

    def update(self, metrics: Any, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        probabilities, truth = self.pairs(outputs, targets)
        average_precision, f1 = metrics.values()  # as `metrics` names them
        average_precision.update(probabilities, truth)
        f1.update(probabilities.flatten(), truth.flatten())


@functools.cache
def present_labels_ap() -> type:
    """The metric class, made once where metrics are (torchmetrics is imported there: a run
    without validation never pays for it)."""
    from torchmetrics.classification import MultilabelAveragePrecision
    from torchmetrics.utilities import dim_zero_cat

    class PresentLabelsAP(MultilabelAveragePrecision):
        """Macro average precision over the labels with at least one positive (COCO's and
        scikit-learn's mAP): a label absent from the validation set has no precision to
        average, where torchmetrics would count it as 0."""

        def __init__(self, num_labels: int) -> None:
            super().__init__(num_labels=num_labels, average="none")

        def compute(self) -> torch.Tensor:
            with warnings.catch_warnings():  # "No positive samples found": the absent labels
                warnings.simplefilter("ignore", UserWarning)
                per_label = super().compute()
            present = (dim_zero_cat(self.target) == 1).any(dim=0)
            if not bool(present.any()):
                return torch.tensor(float("nan"))
            return per_label[present].mean()

    return PresentLabelsAP
