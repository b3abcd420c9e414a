"""`train.py` without the loop's check of losses and signals, to measure what it costs.

Used by scripts/bench.py only, never to train: `Trainer.check_finite_and_signals` (a device-side
note of `isfinite(loss)` every step; at log and checkpoint steps a host read and, with several
ranks, a small all-reduce) is replaced by "always step". The patch sits at module level, so the
ddp workers get it too: the elastic launcher starts them with multiprocessing's spawn, which
re-imports the main module (this file) in every child.
"""

from __future__ import annotations

from typing import Any

import hydra
from bench_common import REPO  # also puts this checkout's dpt on sys.path
from omegaconf import DictConfig

from dpt.cli import run, task
from dpt.trainer import Trainer


def _always_step(self: Trainer, loss: Any, stop: Any) -> tuple[bool, bool]:
    return True, False  # (apply the update, stop after this step): no check, no collective


Trainer.check_finite_and_signals = _always_step  # type: ignore[method-assign]


# train.py's entry point, defined here so that this file stays the main module the workers import.
@hydra.main(config_path=str(REPO / "conf"), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Any:
    return task(cfg)


if __name__ == "__main__":
    run(main)
