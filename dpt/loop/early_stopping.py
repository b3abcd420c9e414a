"""Early stopping: end the run when a validation metric stops improving for `patience`
validations (epochs, or trainer.val_every_n_steps' points)."""

from __future__ import annotations

import logging
from typing import Any

from dpt.config.trainer import EarlyStoppingConfig
from dpt.errors import DptError

log = logging.getLogger("dpt")


class EarlyStopping:
    """Holds the best value seen and the validations since; checkpointed with the rest of the
    run (as `stale_epochs`, the name checkpoints have always had)."""

    def __init__(
        self, settings: EarlyStoppingConfig, verbose: bool = True, per: str = "epoch"
    ) -> None:
        self.settings, self.verbose = settings, verbose  # verbose: one line from rank 0 only
        self.per = per  # what one validation is, for the line: an epoch, or a validation
        self.best: float | None = None
        self.stale_epochs = 0

    def should_stop(self, val: dict[str, float]) -> bool:
        """Called at each validation with the world's metrics (the same on every rank)."""
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
            log.info(f"early stopping: {es.metric} did not improve for {es.patience} {self.per}(s)")
        return True

    def _better(self, value: float, best: float) -> bool:
        delta = self.settings.min_delta
        return value < best - delta if self.settings.mode == "min" else value > best + delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stale_epochs": self.stale_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.stale_epochs = state["best"], int(state["stale_epochs"])
