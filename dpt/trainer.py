"""The training loop: forward, loss, backward, step. Everything else is called from here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from dpt.data.loaders import Loaders
from dpt.distributed import DistEnv, all_reduce_sum
from dpt.evaluate import evaluate
from dpt.metrics import MetricsLogger

log = logging.getLogger("dpt")


@dataclass
class TrainResult:
    steps: int = 0
    samples: int = 0  # world-wide
    wall_time_s: float = 0.0
    final_loss: float | None = None
    bad_samples: int = 0  # world-wide, skipped unreadable inputs
    val: dict[str, float] = field(default_factory=dict)
    best_val: dict[str, float] = field(default_factory=dict)


def planned_steps(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    total = steps_per_epoch * epochs
    return min(total, max_steps) if max_steps is not None else total


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Loaders,
    env: DistEnv,
    metrics: MetricsLogger,
    *,
    epochs: int,
    max_steps: int | None,
    num_classes: int,
) -> TrainResult:
    loss_fn = nn.CrossEntropyLoss()
    non_blocking = env.device.type == "cuda"  # pinned batches copy while the GPU computes
    total_steps = planned_steps(len(loaders.train), epochs, max_steps)
    result = TrainResult()
    step = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        loaders.train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        bad_in_epoch = 0
        fetch_start = time.perf_counter()
        for inputs, labels, bad in loaders.train:
            inputs = inputs.to(env.device, non_blocking=non_blocking)
            labels = labels.to(env.device, non_blocking=non_blocking)
            data_s = time.perf_counter() - fetch_start
            bad_in_epoch += bad

            loss = loss_fn(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # under DDP the gradient all-reduce overlaps with this
            optimizer.step()

            step += 1
            result.samples += len(labels)
            metrics.step(step, epoch, loss, len(labels), data_s, optimizer.param_groups[0]["lr"])
            if step >= total_steps:
                break
            fetch_start = time.perf_counter()
        if step % metrics.log_every:  # the last partial window still gets its point
            metrics.flush(step, epoch, optimizer.param_groups[0]["lr"])
        _end_of_epoch(
            model,
            loaders,
            env,
            metrics,
            result,
            epoch,
            step,
            bad_in_epoch,
            num_classes,
            non_blocking,
        )
        if step >= total_steps:
            break
    result.steps = step
    result.wall_time_s = time.perf_counter() - start
    result.samples = int(all_reduce_sum([result.samples], env)[0])
    result.final_loss = metrics.last_world_loss
    return result


def _end_of_epoch(
    model: nn.Module,
    loaders: Loaders,
    env: DistEnv,
    metrics: MetricsLogger,
    result: TrainResult,
    epoch: int,
    step: int,
    bad_in_epoch: int,
    num_classes: int,
    non_blocking: bool,
) -> None:
    (bad,) = all_reduce_sum([bad_in_epoch], env)
    result.bad_samples += int(bad)
    parts = [f"epoch {epoch + 1} done", f"step {step}"]
    if metrics.last_world_loss is not None:
        parts.append(f"train loss {metrics.last_world_loss:.4f}")
    if loaders.val is not None:
        result.val = evaluate(model, loaders.val, env, num_classes, non_blocking)
        metrics.scalars(result.val, step)
        for key, value in result.val.items():
            better = (
                value < result.best_val.get(key, float("inf"))
                if key == "val/loss"
                else (value > result.best_val.get(key, float("-inf")))
            )
            if better:
                result.best_val[key] = value
        parts += [_format_val(k, v) for k, v in sorted(result.val.items(), key=_val_order)]
    if bad:
        parts.append(f"{int(bad)} unreadable samples skipped")
    if env.is_main:  # world-wide numbers: one line, not one per rank
        log.info(" | ".join(parts))


def _val_order(item: tuple[str, float]) -> tuple[bool, str]:
    return (item[0] != "val/loss", item[0])  # loss first, then accuracies


def _format_val(key: str, value: float) -> str:
    name = key.replace("/", " ")
    return f"{name} {value:.2%}" if "acc" in key else f"{name} {value:.4f}"
