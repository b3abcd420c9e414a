"""Validation across all ranks (every sample counted exactly once, see ShardSampler), and the
best value of each metric so far."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpt.distributed import DistEnv, all_gather_floats


class Validation:
    """Runs `evaluate` at epoch ends and keeps the best value of each metric (checkpointed)."""

    def __init__(
        self,
        loader: DataLoader | None,
        env: DistEnv,
        num_classes: int,
        autocast: Callable[[], AbstractContextManager[Any]],
        to_device: Callable[[torch.Tensor], torch.Tensor],
        lockstep_shape: tuple[int, ...] | None,
    ) -> None:
        self.loader, self.env, self.num_classes = loader, env, num_classes
        self.autocast, self.to_device = autocast, to_device
        self.lockstep_shape = lockstep_shape  # see `evaluate`
        self.last: dict[str, float] = {}
        self.best: dict[str, float] = {}

    def run(self, model: nn.Module) -> dict[str, float]:
        """World-wide metrics ({} without a validation split); all ranks must call it."""
        if self.loader is None:
            return {}
        self.last = evaluate(
            model, self.loader, self.env, self.num_classes, self.autocast, self.to_device,
            self.lockstep_shape,
        )  # fmt: skip
        for key, value in self.last.items():
            best = self.best.get(key)
            if best is None or (value < best if key.endswith("loss") else value > best):
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
    num_classes: int,
    autocast: Callable[[], AbstractContextManager[Any]],
    to_device: Callable[[torch.Tensor], torch.Tensor],
    lockstep_shape: tuple[int, ...] | None = None,
) -> dict[str, float]:
    """World-wide loss, top-1 and (with >= 5 classes) top-5 accuracy; all ranks must call it.
    `lockstep_shape` (one input's shape; fsdp, whose every forward is a collective): every rank
    runs as many forwards as the rank with the most batches, the missing ones on empty inputs."""
    import torchmetrics  # here: a run without validation never pays for the import

    metrics = {
        "loss": torchmetrics.MeanMetric(),
        "acc1": _accuracy(torchmetrics, num_classes, 1),
        "samples": torchmetrics.SumMetric(),  # proves each sample was counted exactly once
    }
    if num_classes >= 5:
        metrics["acc5"] = _accuracy(torchmetrics, num_classes, 5)
    collection = torchmetrics.MetricCollection(metrics, compute_groups=False).to(env.device)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    was_training = model.training
    model.eval()
    # Agreed before the first forward: a collective of its own amid fsdp's would mismatch them.
    padding = _missing_forwards(len(loader), env) if lockstep_shape is not None else 0
    for inputs, labels, _ in loader:
        if not len(labels) and lockstep_shape is None:  # all unreadable (the loader counted them)
            continue
        inputs = to_device(inputs)
        labels = labels.to(env.device, non_blocking=inputs.is_cuda)
        with autocast():
            logits = model(inputs).float()
        if not len(labels):
            continue
        collection["loss"].update(loss_fn(logits, labels))
        collection["samples"].update(torch.tensor(float(len(labels))))
        for name in ("acc1", "acc5"):
            if name in collection:
                collection[name].update(logits, labels)
    for _ in range(padding):
        with autocast():
            model(to_device(torch.zeros(0, *lockstep_shape or ())))
    model.train(was_training)
    # compute() all-gathers the metric states from every rank (sums: uneven shards are fine).
    return {f"val/{k}": float(v) for k, v in collection.compute().items()}


def _missing_forwards(batches: int, env: DistEnv) -> int:
    """How many batches fewer than the busiest rank this rank has."""
    return max(int(row[0]) for row in all_gather_floats([float(batches)], env)) - batches


def _accuracy(torchmetrics: Any, num_classes: int, top_k: int) -> Any:
    return torchmetrics.classification.MulticlassAccuracy(
        num_classes=num_classes, top_k=top_k, average="micro"
    )
