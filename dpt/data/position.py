"""Where the training data stands, in samples of the epoch's global order: what a checkpoint
keeps so that a run resumes at the same sample on any world size or batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class DataPosition:
    """Where the data stands: the epoch in progress (0-based), the samples of its global order
    trained on (see dpt.data.loaders.epoch_order), and the global batch they were taken in. In
    samples, not steps: a run resumed on another world size or batch starts at the same sample."""

    epoch: int = 0
    sample: int = 0
    global_batch: int = 0

    def next_epoch(self) -> None:
        self.epoch, self.sample = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.sample = int(state["epoch"]), int(state["sample"])
        self.global_batch = int(state["global_batch"])
