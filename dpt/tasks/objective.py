"""The number a search optimizes (`sweep.objective`) and its direction, from the config before a
run, and its value from a run's results.

`auto` is the metric the run watches (`trainer.early_stopping.metric`, in its `mode`) where the
run has validation, else the final training loss. A validation metric's value is that of its
best epoch (what `model_best.pt` holds where it watches that metric); `train/loss` is the last
logging window's world-mean loss. Nothing here imports torch (but a custom task's metric class,
asked which way it improves): the sweeper reads it in the launching process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from dpt.config.datasets import no_validation
from dpt.config.tasks import ClassificationTaskConfig, higher_is_better, task_higher_is_better
from dpt.config.trainer import AUTO_OBJECTIVE, TRAIN_LOSS


@dataclass(frozen=True)
class Objective:
    name: str  # train/loss or one of the task's validation metrics (val/loss, val/acc1, ...)
    direction: str  # minimize or maximize

    def value(self, summary: dict[str, Any]) -> float:
        """Its value in a run's results (metrics.json); NaN where the run has none."""
        if self.name == TRAIN_LOSS:
            found = summary.get("final_loss")
        else:
            found = (summary.get("best_per_metric") or {}).get(self.name)
        return float(found) if found is not None else math.nan

    def record(self, summary: dict[str, Any]) -> dict[str, Any]:
        """What metrics.json says of it: name, direction and value (null: none)."""
        value = self.value(summary)
        return {"name": self.name, "direction": self.direction,
                "value": value if math.isfinite(value) else None}  # fmt: skip


def resolve(
    name: str,
    watched: str,
    mode: str,
    has_validation: bool,
    higher: Callable[[str], bool] | None = None,
) -> Objective:
    """`sweep.objective` made definite: `auto` is the watched metric, or train/loss. `higher`
    says which way a validation metric improves (the task's; classification's by default)."""
    if name == AUTO_OBJECTIVE:
        if not has_validation:
            return Objective(TRAIN_LOSS, "minimize")
        return Objective(watched, "maximize" if mode == "max" else "minimize")
    if name == TRAIN_LOSS:
        return Objective(name, "minimize")
    better_higher = (higher or _classification_higher)(name)
    return Objective(name, "maximize" if better_higher else "minimize")


def _classification_higher(metric: str) -> bool:
    return bool(higher_is_better(ClassificationTaskConfig, metric, None, None))


def of_config(cfg: DictConfig) -> Objective:
    """The objective a composed config's runs report (before any of them runs)."""
    es = cfg.trainer.early_stopping
    has_validation = no_validation(cfg.dataset) is None
    return resolve(cfg.sweep.objective, es.metric, es.mode, has_validation,
                   lambda metric: metric_higher(cfg.task, metric))  # fmt: skip


def metric_higher(task: DictConfig, metric: str) -> bool:
    """Which way a metric of the composed `task` improves; a custom metric's class is asked
    (imported) where the config cannot say."""
    found = task_higher_is_better(task, metric)
    if found is not None:
        return found
    from dpt.tasks.custom import metric_direction

    name = metric.removeprefix("val/")
    return metric_direction(name, task.metrics[name]) is not False
