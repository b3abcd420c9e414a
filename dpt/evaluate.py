"""Validation across all ranks: every sample counted exactly once (see ShardSampler)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader

from dpt.distributed import DistEnv


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    env: DistEnv,
    num_classes: int,
    non_blocking: bool = False,
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """World-wide loss, top-1 and (with >= 5 classes) top-5 accuracy; all ranks must call it."""
    metrics = {
        "loss": torchmetrics.MeanMetric(),
        "acc1": _accuracy(num_classes, 1),
        "samples": torchmetrics.SumMetric(),  # proves each sample was counted exactly once
    }
    if num_classes >= 5:
        metrics["acc5"] = _accuracy(num_classes, 5)
    collection = torchmetrics.MetricCollection(metrics, compute_groups=False).to(env.device)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    was_training = model.training
    model.eval()
    for inputs, labels, _ in loader:
        inputs = (
            to_device(inputs) if to_device else inputs.to(env.device, non_blocking=non_blocking)
        )
        labels = labels.to(env.device, non_blocking=non_blocking)
        with autocast():
            logits = model(inputs).float()
        collection["loss"].update(loss_fn(logits, labels))
        collection["samples"].update(torch.tensor(float(len(labels))))
        for name in ("acc1", "acc5"):
            if name in collection:
                collection[name].update(logits, labels)
    model.train(was_training)
    # compute() all-gathers the metric states from every rank (sums: uneven shards are fine).
    return {f"val/{k}": float(v) for k, v in collection.compute().items()}


def _accuracy(num_classes: int, top_k: int) -> torchmetrics.Metric:
    return torchmetrics.classification.MulticlassAccuracy(
        num_classes=num_classes, top_k=top_k, average="micro"
    )
