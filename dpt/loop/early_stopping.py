"""Early stopping: end the run when a validation metric stops improving for `patience` epochs."""

from __future__ import annotations

import logging
from typing import Any

from dpt.config.trainer import EarlyStoppingConfig
from dpt.errors import DptError

log = logging.getLogger("dpt")


class EarlyStopping:
    """Holds the best value seen and the epochs since; checkpointed with the rest of the run."""

    def __init__(self, settings: EarlyStoppingConfig, verbose: bool = True) -> None:
        self.settings, self.verbose = settings, verbose  # verbose: one line from rank 0 only
        self.best: float | None = None
        self.stale_epochs = 0

    def should_stop(self, val: dict[str, float]) -> bool:
        """Called once per epoch with the world's validation metrics (the same on every rank)."""
        es = self.settings
        if es.patience is None:
            return False
        if es.metric not in val:
            raise DptError(
                f"trainer.early_stopping.metric={es.metric}: not among the validation "
                f"metrics ({', '.join(val) or 'no validation split'})"
            )
        value = val[es.metric]
        if self.best is None or self._better(value, self.best):
            self.best, self.stale_epochs = value, 0
            return False
        self.stale_epochs += 1
        if self.stale_epochs < es.patience:
            return False
        if self.verbose:
            log.info(f"early stopping: {es.metric} did not improve for {es.patience} epoch(s)")
        return True

    def _better(self, value: float, best: float) -> bool:
        delta = self.settings.min_delta
        return value < best - delta if self.settings.mode == "min" else value > best + delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stale_epochs": self.stale_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.stale_epochs = state["best"], int(state["stale_epochs"])
