"""Validation across all ranks (every sample counted exactly once, see ShardSampler), and the
best value of each metric so far."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpt.config.tasks import CUSTOM
from dpt.distributed import DistEnv, all_gather_floats
from dpt.tasks.metrics_import import import_torchmetrics
from dpt.tasks.task import Task

log = logging.getLogger("dpt")


class Validation:
    """Runs `evaluate` at epoch ends and keeps the best value of each metric (checkpointed)."""

    def __init__(
        self,
        loader: DataLoader | None,
        env: DistEnv,
        task: Task,
        autocast: Callable[[], AbstractContextManager[Any]],
        to_device: Callable[[torch.Tensor], torch.Tensor],
        lockstep: torch.Tensor | None,
        counted: bool = True,
        max_batches: int | None = None,
    ) -> None:
        """`counted`: whether this rank's batches count in the world's metrics (the ranks of a
        tensor-parallel group run the same batches: one of them counts them); `max_batches`:
        each rank's first batches only (trainer.val_batches)."""
        self.loader, self.env, self.task = loader, env, task
        self.counted, self.max_batches = counted, max_batches
        self.autocast, self.to_device = autocast, to_device
        self.lockstep = lockstep  # see `evaluate`
        self.last: dict[str, float] = {}
        self.best: dict[str, float] = {}
        self.partial = False  # the last validation read fewer samples than the split holds

    def run(self, model: nn.Module) -> dict[str, float]:
        """World-wide metrics ({} without a validation split); all ranks must call it. A
        validation that could not have all of its split (a shard skipped) gives {} too: metrics
        of another set of samples would not compare with other epochs'. (Unreadable samples,
        a corrupt image, are left out every epoch alike.)"""
        self.partial = False
        if self.loader is None:
            return {}
        self.last = evaluate(
            model, self.loader, self.env, self.task, self.autocast, self.to_device,
            self.lockstep, self.counted, max_batches=self.max_batches,
        )  # fmt: skip
        missing = int(self.last.pop("val/missing"))
        if missing:
            if self.env.is_main:
                size = len(self.loader.dataset)  # type: ignore[arg-type]
                log.warning(
                    f"validation could not have {missing} of the split's {size} samples (their "
                    "shards could not be fetched): its metrics are not reported, and not used for "
                    "early stopping or model_best.pt"
                )
            self.partial, self.last = True, {}
            return {}
        for key, value in self.last.items():
            best = self.best.get(key)
            if best is None or (value > best if self.task.higher_is_better(key) else value < best):
                self.best[key] = value
        return self.last

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = dict(state["best"])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    env: DistEnv,
    task: Task,
    autocast: Callable[[], AbstractContextManager[Any]],
    to_device: Callable[[torch.Tensor], torch.Tensor],
    lockstep: torch.Tensor | None = None,
    counted: bool = True,
    on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    max_batches: int | None = None,
) -> dict[str, float]:
    """World-wide loss and the task's metrics; all ranks must call it. `lockstep` (one input of
    zeros; fsdp, whose every forward is a collective): every rank runs as many
    forwards as the rank with the most batches, the missing ones on that input. `counted`
    false: the forwards run (collectives of a tensor-parallel group), the metrics skip them.
    `on_batch(outputs, targets)`: sees each counted batch after the task's metrics did
    (dpt-evaluate's per-class table, confusion matrix and scatter plot). `max_batches`: this
    rank's first batches only."""
    # Here: a run without validation never pays for the import.
    torchmetrics = import_torchmetrics(any_metric=task.kind == CUSTOM)

    metrics = {
        "loss": torchmetrics.MeanMetric(),
        **task.metrics(),
        "samples": torchmetrics.SumMetric(),  # proves each sample was counted exactly once
    }
    # Samples whose shard could not be had: the metrics then cover less than the split.
    metrics["missing"] = missing = torchmetrics.SumMetric()
    collection = torchmetrics.MetricCollection(metrics, compute_groups=False).to(env.device)
    own = {name: collection[name] for name in metrics if name not in ("loss", "samples", "missing")}
    was_training = model.training
    model.eval()
    # Agreed before the first forward: a collective of its own amid fsdp's would mismatch them.
    batches = len(loader) if max_batches is None else min(len(loader), max_batches)
    padding = _missing_forwards(batches, env) if lockstep is not None else 0
    for inputs, targets, skipped in itertools.islice(loader, batches):
        if not counted:  # the same forward as the counting rank's, the empty batch's too
            _forward_in_step(model, inputs if len(targets) else lockstep, autocast, to_device)
            continue
        missing.update(torch.tensor(float(getattr(skipped, "missing", 0))))
        if not len(targets):  # all unreadable (the loader counted them)
            if lockstep is not None:  # fsdp: the forward is a collective all the same
                _forward_in_step(model, lockstep, autocast, to_device)
            continue
        inputs = to_device(inputs)
        targets = targets.to(env.device, non_blocking=inputs.is_cuda)
        with autocast():
            outputs = model(inputs).float()
        losses = task.sample_losses(outputs, targets)
        # One per sample (weighed by the task, e.g. by its scored tokens), or the batch's mean
        # (a custom loss), counted once per sample.
        weight = task.sample_weights(targets) if losses.dim() else float(len(targets))
        collection["loss"].update(losses, weight=1.0 if weight is None else weight)
        collection["samples"].update(torch.tensor(float(len(targets))))
        task.update(own, outputs, targets)
        if on_batch is not None:
            on_batch(outputs, targets)
    for _ in range(padding):
        _forward_in_step(model, lockstep, autocast, to_device)
    model.train(was_training)
    # compute() all-gathers the metric states from every rank (sums: uneven shards are fine).
    return {f"val/{k}": float(v) for k, v in collection.compute().items()}


def _forward_in_step(
    model: nn.Module,
    lockstep: torch.Tensor,
    autocast: Callable[[], AbstractContextManager[Any]],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """A forward whose output is not used: it keeps this rank's collectives in step."""
    with autocast():
        model(to_device(lockstep))


def _missing_forwards(batches: int, env: DistEnv) -> int:
    """How many batches fewer than the busiest rank this rank has."""
    return max(int(row[0]) for row in all_gather_floats([float(batches)], env)) - batches
