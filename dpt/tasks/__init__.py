"""Tasks: what is learned. Each task is the loss of (outputs, targets), the validation metrics
(torchmetrics, reduced over the world), what a target is (`fit`: the rules a task's data and
model must meet, one line each where they do not), the watched metric, and what prediction
writes of an output. The loop, validation, the best model, early stopping, the sweep's objective
and `dpt-predict` ask the task; none of them assumes classes.

`task=classification` (the default), `binary`, `multilabel`, `regression`, and `custom` (your
own loss and metrics by `_target_`). This package's `__init__` and `fit` import no torch: the
launching process checks a config with them before any process starts.

May import: base.
"""
