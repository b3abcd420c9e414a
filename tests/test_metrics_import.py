"""dpt's own metrics import torchmetrics without transformers (0.6 to 2.8 s a run, paid only by
runs of model=hf); a task of yours gets torchmetrics whole. Fresh interpreters: what a run's
process imports."""

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
print('transformers' in sys.modules, round(float(accuracy), 4))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("any_metric", "imported"), [(False, "False"), (True, "True")])
def test_dpts_metrics_leave_transformers_unimported(any_metric: bool, imported: str) -> None:
    probe = [sys.executable, "-c", PROBE.format(any_metric=any_metric)]
    out = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=110).stdout
    assert out.split() == [imported, "0.6667"]
