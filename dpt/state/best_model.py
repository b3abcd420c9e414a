"""The best model so far: `model_best.pt`, the weights of the epoch whose watched validation
metric (`trainer.early_stopping.metric`, better by `.mode`) was the best, kept beside `model.pt`
(the last step's). Its record (value, step, epoch, that epoch's metrics) is checkpointed, so a
resumed run compares against the same best."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpt.distributed import DistEnv
from dpt.state.results import BEST_MODEL
from dpt.state.stateful import full_state_dict


class BestModel:
    # Checkpoints written before this part existed load without it (dpt.state.checkpoint).
    optional = True

    def __init__(self, metric: str, mode: str, enabled: bool, run_dir: Path, env: DistEnv) -> None:
        self.metric, self.mode, self.enabled = metric, mode, enabled
        self.path, self.env = run_dir / BEST_MODEL, env
        self.value: float | None = None
        self.step: int | None = None
        self.epoch: int | None = None
        self.val: dict[str, float] = {}

    def update(self, val: dict[str, float], step: int, epoch: int, model: nn.Module) -> bool:
        """After an epoch's validation (the world's metrics: the same on every rank, so every
        rank takes the same branch, as fsdp's gather needs); True when this epoch is the best."""
        value = val.get(self.metric)
        if not self.enabled or value is None or not self._better(value):
            return False
        self.value, self.step, self.epoch, self.val = value, step, epoch, dict(val)
        weights = full_state_dict(model)  # all ranks: fsdp gathers the shards to rank 0
        if self.env.is_main:
            from dpt.state.checkpoint import write_atomically

            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, lambda f: torch.save(weights, f), "best model")
        return True

    def _better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value

    def summary(self) -> dict[str, Any] | None:
        """For metrics.json: which epoch `model_best.pt` holds, and its validation metrics."""
        if self.step is None:
            return None
        return {"metric": self.metric, "mode": self.mode, "value": self.value,
                "step": self.step, "epoch": self.epoch, "val": self.val}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "step": self.step, "epoch": self.epoch, "val": self.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.step, self.epoch = state["value"], state["step"], state["epoch"]
        self.val = dict(state["val"])
