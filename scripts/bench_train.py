"""`train.py`, stamping the moment its first optimizer step returns: for the start-up benchmark.

Used by scripts/bench.py only. With DPT_BENCH_FIRST_STEP=<file> in the environment, rank 0
writes `time.time()` there when its first `optimizer.step()` returns, through a global optimizer
hook that then removes itself: nothing else differs from `train.py`, and the plain loop stamps
the same moment (scripts/plain_loop.py). Stamping at a logging step instead would bill dpt for
its first metrics write (TensorBoard's import) and the plain loop for its first print. The hook
sits at module level, so the ddp workers get it too: the elastic launcher starts them with
multiprocessing's spawn, which re-imports the main module (this file) in every child.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import hydra
from bench_common import FIRST_STEP_ENV  # importing it puts this checkout's dpt on sys.path
from omegaconf import DictConfig
from torch.optim.optimizer import register_optimizer_step_post_hook

from dpt.cli import CONFIG_NAME, CONFIG_PATH, run, task


def _stamp_first_step(path: Path) -> None:
    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        stamped = time.time()
        handle.remove()  # the steps after the first run without it
        # Read here, not at import: a spawned ddp worker imports this file before the elastic
        # launcher's wrapper sets its RANK. Unset: a single process.
        if os.environ.get("RANK", "0") == "0":
            path.write_text(repr(stamped))

    handle = register_optimizer_step_post_hook(hook)


if os.environ.get(FIRST_STEP_ENV):
    _stamp_first_step(Path(os.environ[FIRST_STEP_ENV]))


# train.py's entry point, defined here so that this file stays the main module the workers import.
@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> Any:
    return task(cfg)


if __name__ == "__main__":
    run(main)
