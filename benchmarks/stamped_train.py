"""`train.py`, stamping the moment its first optimizer step returns: for the start-up benchmark.

Run by the benchmark only (benchmarks/jobs.py starts it as a file, as users start `train.py`).
With DPT_BENCH_FIRST_STEP=<file> in the environment, rank 0 writes `time.time()` there when its
first `optimizer.step()` returns, through a global optimizer hook that then removes itself:
nothing else differs from `train.py`, and the plain loop stamps the same moment
(benchmarks/plain_loop.py). Stamping at a logging step instead would bill dpt for its first
metrics write (TensorBoard's import) and the plain loop for its first print.

Like `train.py`, this file imports neither torch nor the CLI at module level: a single run gets
the hook when its job starts; each rank of a local world runs this file again as `__mp_main__`
(multiprocessing's way to find the main module) and gets the hook then.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # dpt from this checkout, wherever the file is started from
    sys.path.insert(0, str(REPO))

# The file in which this script stamps dpt's first optimizer step (unset: no stamp).
FIRST_STEP_ENV = "DPT_BENCH_FIRST_STEP"


def stamp_first_step() -> None:
    """With FIRST_STEP_ENV set, rank 0 writes the time its first optimizer step returned."""
    if not os.environ.get(FIRST_STEP_ENV):
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    path = Path(os.environ[FIRST_STEP_ENV])

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        stamped = time.time()
        handle.remove()  # the steps after the first run without it
        # Read here, not at import: the elastic agent sets a rank's RANK when it starts the
        # rank's function, after multiprocessing ran this file. Unset: a single process.
        if os.environ.get("RANK", "0") == "0":
            path.write_text(repr(stamped))

    handle = register_optimizer_step_post_hook(hook)


def main() -> None:
    import hydra

    from dpt.config import is_distributed
    from dpt.launch.cli import run, task
    from dpt.launch.hydra_run import CONFIG_NAME, CONFIG_PATH

    @hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
    def bench_main(cfg: Any) -> Any:
        if not is_distributed(cfg.strategy):  # else the launcher never steps; its ranks stamp
            stamp_first_step()
        return task(cfg)

    run(bench_main)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    stamp_first_step()
