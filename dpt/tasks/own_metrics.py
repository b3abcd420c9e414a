"""Imported by a local world's fork server (dpt/launch/fork_server.py) for a run whose metrics
are dpt's own: torchmetrics is imported there once, as dpt/tasks/metrics_import.py imports it
for such a run, and every rank forks with it instead of importing it at its first validation."""

from dpt.tasks.metrics_import import import_torchmetrics

import_torchmetrics(any_metric=False)
