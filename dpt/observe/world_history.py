"""The world's metrics at their steps, as rank 0 logs them: one row per logged step.

Kept in the run's checkpoints (a resumed run holds its whole history, up to the step it resumed
from, as TensorBoard's curves do after their purge), written to `metrics.json` (`history`) at
the end, and the rows `metrics.csv` and the trackers get.
"""

from __future__ import annotations

from typing import Any

STEP = "step"


class WorldHistory:
    optional = True  # checkpoints written before it load without it: an empty history

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def add(self, scalars: dict[str, float], step: int) -> None:
        """Scalars at `step`, into that step's row (validation joins its step's training row)."""
        if self.rows and self.rows[-1][STEP] == step:
            self.rows[-1].update(scalars)
        else:
            self.rows.append({STEP: step, **scalars})

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = [dict(row) for row in state["rows"]]
