"""dpt's own metrics import torchmetrics without transformers, scipy, torchvision and matplotlib
(2 to 6 s a process, paid only where a run imports one of them itself); a task of yours gets
torchmetrics whole. Fresh interpreters: what a run's process imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # fresh interpreters: processes of their own

PROBE = """
import sys
from dpt.tasks.metrics_import import import_torchmetrics
torchmetrics = import_torchmetrics(any_metric={any_metric})
from torchmetrics.classification import MulticlassAccuracy
import torch
metric = MulticlassAccuracy(num_classes=3, average="micro")
accuracy = metric(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
hidden = ("transformers", "scipy", "torchvision", "matplotlib")
print([name in sys.modules for name in hidden], round(float(accuracy), 4))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("any_metric", [False, True])
def test_dpts_metrics_leave_their_optional_packages_unimported(any_metric: bool) -> None:
    probe = [sys.executable, "-c", PROBE.format(any_metric=any_metric)]
    out = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=110).stdout
    assert out.strip() == f"{[any_metric] * 4} 0.6667"
