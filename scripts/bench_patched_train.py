"""`train.py` without the loop's check of losses and signals, to measure what it costs.

Used by scripts/bench.py only, never to train: `Trainer.check_finite_and_signals` (a device-side
note of `isfinite(loss)` every step; at log and checkpoint steps a host read and, with several
ranks, a small all-reduce) is replaced by "always step". The patch sits at module level, so the
ddp workers get it too: the elastic launcher starts them with multiprocessing's spawn, which
re-imports the main module (this file) in every child.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from dpt.cli import run, task  # noqa: E402
from dpt.trainer import Trainer  # noqa: E402


def _always_step(self: Trainer, loss: Any, stop: Any) -> tuple[bool, bool]:
    return True, False  # (apply the update, stop after this step): no check, no collective


Trainer.check_finite_and_signals = _always_step  # type: ignore[method-assign]


# train.py's entry point, defined here so that this file stays the main module the workers import.
@hydra.main(config_path=str(REPO / "conf"), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Any:
    return task(cfg)


if __name__ == "__main__":
    run(main)
