"""`train.py`, stamping the moment its first optimizer step returns: for the start-up benchmark;
and, on request, each rank's peak resident memory: for the `gpt` section's memory per rank.

Run by the benchmark only (benchmarks/jobs.py starts it as a file, as users start `train.py`).
With DPT_BENCH_FIRST_STEP=<file> in the environment, rank 0 writes `time.time()` there when its
first `optimizer.step()` returns, through a global optimizer hook that then removes itself:
nothing else differs from `train.py`, and the plain loop stamps the same moment
(benchmarks/plain_loop.py). Stamping at a logging step instead would bill dpt for its first
metrics write (TensorBoard's import) and the plain loop for its first print.

With DPT_BENCH_PEAK_RSS=<folder>, every rank writes its peak resident memory in MiB
(`ru_maxrss`, as benchmarks/memory.py reads it in its ranks) to `<folder>/rank<RANK>.txt` after
each optimizer step that raised it (a global optimizer hook: one `getrusage` a step): the peak
over the training steps, whatever comes after the last one (the final weights' save) left out.

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
# The folder in which every rank stamps its peak resident memory (unset: no stamp).
PEAK_RSS_ENV = "DPT_BENCH_PEAK_RSS"
PEAK_RSS_FILE = "rank{rank}.txt"


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


def stamp_peak_rss() -> None:
    """With PEAK_RSS_ENV set, every rank writes its peak resident memory (MiB) whenever an
    optimizer step raised it."""
    if not os.environ.get(PEAK_RSS_ENV):
        return
    import resource

    from torch.optim.optimizer import register_optimizer_step_post_hook

    folder, peak = Path(os.environ[PEAK_RSS_ENV]), [0]

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        if kib > peak[0]:
            peak[0] = kib
            folder.mkdir(parents=True, exist_ok=True)
            # RANK read here, as above: set when the rank's function starts.
            name = PEAK_RSS_FILE.format(rank=os.environ.get("RANK", "0"))
            (folder / name).write_text(repr(kib / 1024))

    register_optimizer_step_post_hook(hook)


def stamp() -> None:
    # The peak-RSS hook first: the first-step hook removes itself while torch iterates over the
    # hooks (an OrderedDict), which Python allows only to the last one in it.
    stamp_peak_rss()
    stamp_first_step()


def main() -> None:
    import hydra

    from dpt.config.strategies import is_distributed
    from dpt.launch.cli import run, task
    from dpt.launch.hydra_run import CONFIG_NAME, CONFIG_PATH

    @hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
    def bench_main(cfg: Any) -> Any:
        if not is_distributed(cfg.strategy):  # else the launcher never steps; its ranks stamp
            stamp()
        return task(cfg)

    run(bench_main)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    stamp()
