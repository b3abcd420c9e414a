"""The number a search optimizes (`sweep.objective`) and its direction, from the config before a
run, and its value from a run's results.

`auto` is the metric the run watches (`trainer.early_stopping.metric`, in its `mode`) where the
run has validation, else the final training loss. A validation metric's value is that of its
best epoch (what `model_best.pt` holds where it watches that metric); `train/loss` is the last
logging window's world-mean loss. Nothing here imports torch: the sweeper reads it in the
launching process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from dpt.config import OBJECTIVES

AUTO, TRAIN_LOSS = OBJECTIVES[0], OBJECTIVES[-1]


@dataclass(frozen=True)
class Objective:
    name: str  # val/loss, val/acc1, val/acc5, train/loss
    direction: str  # minimize or maximize

    def value(self, summary: dict[str, Any]) -> float:
        """Its value in a run's results (metrics.json); NaN where the run has none."""
        if self.name == TRAIN_LOSS:
            found = summary.get("final_loss")
        else:
            found = (summary.get("best_val") or {}).get(self.name)
        return float(found) if found is not None else math.nan

    def record(self, summary: dict[str, Any]) -> dict[str, Any]:
        """What metrics.json says of it: name, direction and value (null: none)."""
        value = self.value(summary)
        return {"name": self.name, "direction": self.direction,
                "value": value if math.isfinite(value) else None}  # fmt: skip


def resolve(name: str, watched: str, mode: str, has_validation: bool) -> Objective:
    """`sweep.objective` made definite: `auto` is the watched metric, or train/loss."""
    if name == AUTO:
        if not has_validation:
            return Objective(TRAIN_LOSS, "minimize")
        return Objective(watched, "maximize" if mode == "max" else "minimize")
    return Objective(name, "maximize" if name.startswith("val/acc") else "minimize")


def of_config(cfg: DictConfig) -> Objective:
    """The objective a composed config's runs report (before any of them runs)."""
    from dpt.launch.validate import no_validation

    es = cfg.trainer.early_stopping
    return resolve(cfg.sweep.objective, es.metric, es.mode, no_validation(cfg.dataset) is None)
